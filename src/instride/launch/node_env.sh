#!/bin/sh
# instride: this node's INSTRIDE_* settings, for a task of a job whose services `instride job`
# started. Two uses:
#   as a Slurm task prolog (`instride job` exports SLURM_TASK_PROLOG=<this file>): prints
#     "export NAME=value" lines, which slurmstepd applies to every task of every `srun` step;
#   with a command (what INSTRIDE_NODE_ENV names; for mpiexec ranks): sets them, runs it.
# The node's data server wrote them to <managed dir>/.instride/node.env when it started; the
# managed directory is INSTRIDE_JOB_DIR with %n = this node's name and %j = INSTRIDE_JOB_ID.
node=${SLURMD_NODENAME:-$(hostname -s)}
dir=$(printf '%s' "$INSTRIDE_JOB_DIR" | sed -e "s|%n|$node|g" -e "s|%j|$INSTRIDE_JOB_ID|g")
envfile="$dir/.instride/node.env"
if [ $# -eq 0 ]; then
    if [ -r "$envfile" ]; then
        cat "$envfile"
    else
        echo "print instride: no instride service on $node for job $INSTRIDE_JOB_ID ($envfile missing)"
    fi
    exit 0
fi
if [ -r "$envfile" ]; then
    while IFS= read -r line; do
        export "${line#export }"
    done < "$envfile"
else
    echo "instride: no instride service on $node for job $INSTRIDE_JOB_ID ($envfile missing)" >&2
fi
exec "$@"
