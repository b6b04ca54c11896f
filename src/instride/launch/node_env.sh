#!/bin/sh
# instride: this node's INSTRIDE_* settings, for a task of a job whose services `instride job`
# started. Two uses:
#   as a Slurm task prolog (`instride job` exports SLURM_TASK_PROLOG=<this file>): prints
#     "export NAME=value" lines, which slurmstepd applies to every task of every `srun` step;
#   with a command (what INSTRIDE_NODE_ENV names; for mpiexec ranks): sets them, runs it.
# The node's data server wrote them to <managed dir>/.instride/node.env when it started; the
# managed directory is INSTRIDE_JOB_DIR with %n = the node's name and %j = INSTRIDE_JOB_ID.
# The node's name is SLURMD_NODENAME, else the short host name, else the host name: the first
# whose node.env names this host (`uname -n`) in its "# host" line, so that a SLURMD_NODENAME
# forwarded from another node (mpiexec forwards the environment) is never trusted.
# Without one, the batch host's INSTRIDE_DIR/ADDR/NODE (inherited) are unset: a step then
# fails to reach a data server instead of using another node's.
host=$(uname -n)
envfile=
for node in "$SLURMD_NODENAME" "${host%%.*}" "$host"; do
    [ -n "$node" ] || continue
    dir=$(printf '%s' "$INSTRIDE_JOB_DIR" | sed -e "s|%n|$node|g" -e "s|%j|$INSTRIDE_JOB_ID|g")
    # (the user's own file in the user's own directory: in a shared one like /dev/shm, another
    # user could have made one naming this host, with settings of theirs)
    if [ -r "$dir/.instride/node.env" ] && [ -O "$dir/.instride/node.env" ] && [ -O "$dir" ] \
        && grep -qxF "# host $host" "$dir/.instride/node.env"
    then
        envfile="$dir/.instride/node.env"
        break
    fi
done
missing="instride: no instride service on $host for job $INSTRIDE_JOB_ID (no node.env of this host under $INSTRIDE_JOB_DIR)"
if [ $# -eq 0 ]; then
    if [ -n "$envfile" ]; then
        grep '^export ' "$envfile"
    else
        echo "print $missing"
        echo "unset INSTRIDE_DIR"
        echo "unset INSTRIDE_ADDR"
        echo "unset INSTRIDE_NODE"
    fi
    exit 0
fi
if [ -n "$envfile" ]; then
    while IFS= read -r line; do
        case $line in
            "export "*) export "${line#export }" ;;
        esac
    done < "$envfile"
else
    echo "$missing" >&2
    unset INSTRIDE_DIR INSTRIDE_ADDR INSTRIDE_NODE
fi
exec "$@"
