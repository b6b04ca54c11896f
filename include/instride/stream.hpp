// instride/stream.hpp -- header-only C++17 file streams that take part in instride.
//
//   instride::ofstream out(dir + "/run7/frame_000042.bin", std::ios::binary);
//   out.write(buf, n);
//   out.close();                 // publishes: the key appears, complete, at once
//
//   instride::ifstream in(dir + "/run7/frame_000042.bin", std::ios::binary);
//   if (!in) std::cerr << std::strerror(in.error());   // e.g. ETIMEDOUT
//
// They need neither libinstride_preload.so nor the Python package: the header
// implements the same protocol as the shim (docs/preload.md).
//
// * A path under the managed directory (INSTRIDE_DIR, default
//   /dev/shm/instride-<uid>, else ${TMPDIR:-/tmp}/instride-<uid>; compared
//   lexically) is a key. Any other path behaves exactly like std::*fstream.
// * ofstream writes to a hidden temp file next to the key
//   (.<name>.instride-<pid>-<hex>.tmp) and close() publishes it: fsync if
//   INSTRIDE_FSYNC=1, then link + unlink (write-once: EEXIST if the key exists)
//   or rename when INSTRIDE_OVERWRITE=1. The destructor closes (and publishes).
//   Appending (std::ios::app) to a key is refused with EPERM.
// * ifstream waits for the key (inotify on its directory) up to
//   INSTRIDE_TIMEOUT seconds (unset/0: forever), then opens it.
// * Cluster mode (INSTRIDE_REDIS_URL set): consume and publish go through the
//   node server's Unix socket (INSTRIDE_SOCKET, default
//   $INSTRIDE_DIR/.instride/node.sock): "CONSUME <ms|-1> <key>" /
//   "PUBLISH <key>", replies "OK <path>" or "ERR <errno> <message>".
// * Failures set failbit (which throws if you enabled exceptions()) and
//   error() returns the errno: ETIMEDOUT, EEXIST, EPERM, ECONNREFUSED, EIO, ...
//
// open() and close() hide, not override, the std:: members: call them on an
// instride stream, not through a std::ofstream& to it.
#ifndef INSTRIDE_STREAM_HPP
#define INSTRIDE_STREAM_HPP

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

namespace instride {
namespace detail {

struct config {
    std::string dir;    // lexically normalized, absolute
    std::string socket; // node server's Unix socket
    double timeout = 0; // seconds, <= 0: forever
    bool fsync = false;
    bool overwrite = false;
    bool cluster = false;
};

inline bool env_true(const char *name)
{
    const char *v = std::getenv(name);
    if (v == nullptr)
        return false;
    std::string s(v);
    for (auto &c : s)
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s == "1" || s == "true" || s == "yes" || s == "on";
}

inline std::string normalize(const std::string &abs)
{
    std::vector<std::string> parts;
    size_t i = 0;
    while (i < abs.size()) {
        while (i < abs.size() && abs[i] == '/')
            i++;
        size_t s = i;
        while (i < abs.size() && abs[i] != '/')
            i++;
        std::string c = abs.substr(s, i - s);
        if (c.empty() || c == ".")
            continue;
        if (c == "..") {
            if (!parts.empty())
                parts.pop_back();
            continue;
        }
        parts.push_back(c);
    }
    std::string out;
    for (auto &p : parts)
        out += "/" + p;
    return out.empty() ? "/" : out;
}

inline std::string absolute(const std::string &p)
{
    if (!p.empty() && p[0] == '/')
        return normalize(p);
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof cwd) == nullptr)
        return std::string();
    return normalize(std::string(cwd) + "/" + p);
}

inline config read_config()
{
    config c;
    const char *d = std::getenv("INSTRIDE_DIR");
    std::string dir;
    if (d != nullptr && *d != '\0') {
        dir = d;
    } else {
        struct stat st;
        std::string uid = std::to_string(static_cast<unsigned>(::getuid()));
        if (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) &&
            ::access("/dev/shm", W_OK | X_OK) == 0) {
            dir = "/dev/shm/instride-" + uid;
        } else {
            const char *t = std::getenv("TMPDIR");
            dir = std::string(t && *t ? t : "/tmp") + "/instride-" + uid;
        }
    }
    c.dir = absolute(dir);
    const char *s = std::getenv("INSTRIDE_SOCKET");
    c.socket = (s && *s) ? std::string(s) : c.dir + "/.instride/node.sock";
    const char *t = std::getenv("INSTRIDE_TIMEOUT");
    if (t && *t) {
        char *end = nullptr;
        double v = std::strtod(t, &end);
        if (end != t && v > 0 && v < 1e9)
            c.timeout = v;
    }
    c.fsync = env_true("INSTRIDE_FSYNC");
    c.overwrite = env_true("INSTRIDE_OVERWRITE");
    const char *r = std::getenv("INSTRIDE_REDIS_URL");
    c.cluster = r != nullptr && *r != '\0';
    return c;
}

// Read once per process, like the shim.
inline const config &cfg()
{
    static const config c = read_config();
    return c;
}

// Is path a key? Fills abs (normalized absolute path) and key.
inline bool managed(const std::string &path, std::string &abs, std::string &key)
{
    if (path.empty() || path.back() == '/')
        return false;
    abs = absolute(path);
    const std::string &dir = cfg().dir;
    if (abs.empty() || dir.empty())
        return false;
    if (dir == "/") {
        key = abs.substr(1);
    } else {
        if (abs.size() <= dir.size() + 1 || abs.compare(0, dir.size(), dir) != 0 ||
            abs[dir.size()] != '/')
            return false;
        key = abs.substr(dir.size() + 1);
    }
    // instride's own names are not keys
    size_t s = 0;
    while (s <= key.size()) {
        size_t e = key.find('/', s);
        std::string comp = key.substr(s, e == std::string::npos ? std::string::npos : e - s);
        if (comp.compare(0, 9, ".instride") == 0)
            return false;
        if (e == std::string::npos) {
            if (comp.size() > 4 && comp[0] == '.' && comp.compare(comp.size() - 4, 4, ".tmp") == 0 &&
                comp.find(".instride-") != std::string::npos)
                return false;
            break;
        }
        s = e + 1;
    }
    return true;
}

inline std::string dirname(const std::string &abs)
{
    size_t p = abs.rfind('/');
    return p == 0 ? std::string("/") : abs.substr(0, p);
}

inline int mkdir_p(const std::string &dir)
{
    if (::mkdir(dir.c_str(), 0777) == 0 || errno == EEXIST)
        return 0;
    if (errno != ENOENT)
        return errno;
    for (size_t i = 1; i < dir.size(); i++) {
        if (dir[i] == '/' && ::mkdir(dir.substr(0, i).c_str(), 0777) != 0 && errno != EEXIST)
            return errno;
    }
    if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST)
        return errno;
    return 0;
}

inline std::string temp_name(const std::string &abs)
{
    static thread_local std::mt19937_64 rng{std::random_device{}() ^
                                            static_cast<unsigned long long>(
                                                std::chrono::steady_clock::now()
                                                    .time_since_epoch()
                                                    .count())};
    size_t p = abs.rfind('/');
    std::string base = abs.substr(p + 1).substr(0, 200);
    char suffix[64];
    std::snprintf(suffix, sizeof suffix, ".instride-%ld-%016llx.tmp", static_cast<long>(::getpid()),
                  static_cast<unsigned long long>(rng()));
    return abs.substr(0, p + 1) + "." + base + suffix;
}

using clock = std::chrono::steady_clock;

inline int remaining_ms(clock::time_point deadline, bool forever)
{
    if (forever)
        return -1;
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - clock::now()).count();
    if (left <= 0)
        return 0;
    return static_cast<int>(std::min<long long>((left + 999) / 1000, 2000000000LL));
}

// One request, one reply line over the node server's Unix socket. Returns 0 or errno.
inline int server_request(const std::string &req, std::string &reply, int wait_ms)
{
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    const std::string &path = cfg().socket;
    if (path.empty() || path.size() >= sizeof sa.sun_path)
        return ENAMETOOLONG;
    std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
    int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return EIO;
    if (::connect(s, reinterpret_cast<sockaddr *>(&sa), sizeof sa) != 0) {
        int e = errno;
        ::close(s);
        return (e == ENOENT || e == ECONNREFUSED) ? ECONNREFUSED : EIO;
    }
    size_t off = 0;
    while (off < req.size()) {
        ssize_t n = ::send(s, req.data() + off, req.size() - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            ::close(s);
            return EIO;
        }
        off += static_cast<size_t>(n);
    }
    bool forever = wait_ms < 0;
    auto deadline = clock::now() + std::chrono::milliseconds(forever ? 0 : wait_ms);
    reply.clear();
    char buf[4096];
    for (;;) {
        pollfd pfd{s, POLLIN, 0};
        int prc = ::poll(&pfd, 1, remaining_ms(deadline, forever));
        if (prc < 0 && errno == EINTR)
            continue;
        if (prc <= 0) {
            ::close(s);
            return prc == 0 ? ETIMEDOUT : EIO;
        }
        ssize_t n = ::recv(s, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0 || reply.size() > 2 * PATH_MAX) {
            ::close(s);
            return EIO;
        }
        reply.append(buf, static_cast<size_t>(n));
        size_t nl = reply.find('\n');
        if (nl != std::string::npos) {
            reply.resize(nl);
            break;
        }
    }
    ::close(s);
    return 0;
}

// "OK <path>" -> 0 (path in out); "ERR <n> <msg>" -> n; anything else -> EIO.
inline int parse_reply(const std::string &reply, std::string *out)
{
    if (reply.compare(0, 3, "OK ") == 0 || reply == "OK") {
        if (out != nullptr) {
            *out = reply.size() > 3 ? reply.substr(3) : std::string();
            if (out->empty() || (*out)[0] != '/')
                return EIO;
        }
        return 0;
    }
    if (reply.compare(0, 4, "ERR ") == 0) {
        long e = std::strtol(reply.c_str() + 4, nullptr, 10);
        return (e > 0 && e < 4096) ? static_cast<int>(e) : EIO;
    }
    return EIO;
}

inline int reply_wait_ms()
{
    return cfg().timeout > 0 ? static_cast<int>(cfg().timeout * 1000.0) + 5000 : -1;
}

// Wait for a key in local mode: stat, arm inotify, stat again, poll.
inline int wait_local(const std::string &abs)
{
    struct stat st;
    if (::stat(abs.c_str(), &st) == 0)
        return 0;
    if (errno != ENOENT)
        return errno;
    bool forever = cfg().timeout <= 0;
    auto deadline = clock::now() + std::chrono::microseconds(
                                       static_cast<long long>(forever ? 0 : cfg().timeout * 1e6));
    std::string dir = dirname(abs);
    if (int e = mkdir_p(dir))
        return e;
    int ifd = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (ifd < 0)
        return errno;
    const uint32_t mask = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR;
    if (::inotify_add_watch(ifd, dir.c_str(), mask) < 0) {
        int e = errno;
        ::close(ifd);
        return e;
    }
    int rc;
    for (;;) {
        if (::stat(abs.c_str(), &st) == 0) {
            rc = 0;
            break;
        }
        if (errno != ENOENT) {
            rc = errno;
            break;
        }
        int ms = remaining_ms(deadline, forever);
        if (ms == 0) {
            rc = ETIMEDOUT;
            break;
        }
        pollfd pfd{ifd, POLLIN, 0};
        int prc = ::poll(&pfd, 1, ms);
        if (prc < 0 && errno != EINTR) {
            rc = errno;
            break;
        }
        if (prc <= 0)
            continue;
        alignas(inotify_event) char ev[4096];
        bool rewatch = false;
        for (;;) {
            ssize_t n = ::read(ifd, ev, sizeof ev);
            if (n <= 0)
                break;
            for (char *q = ev; q < ev + n;) {
                auto *ie = reinterpret_cast<inotify_event *>(q);
                if (ie->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF))
                    rewatch = true;
                q += sizeof(inotify_event) + ie->len;
            }
        }
        if (rewatch && (mkdir_p(dir) != 0 || ::inotify_add_watch(ifd, dir.c_str(), mask) < 0)) {
            rc = errno ? errno : EIO;
            break;
        }
    }
    ::close(ifd);
    return rc;
}

// Consume: 0 with the path to open, or errno.
inline int consume(const std::string &abs, const std::string &key, std::string &open_path)
{
    if (!cfg().cluster) {
        open_path = abs;
        return wait_local(abs);
    }
    if (key.find('\n') != std::string::npos)
        return EINVAL;
    long long tms = cfg().timeout > 0 ? static_cast<long long>(std::ceil(cfg().timeout * 1000)) : -1;
    std::string reply;
    if (int e = server_request("CONSUME " + std::to_string(tms) + " " + key + "\n", reply,
                               reply_wait_ms()))
        return e;
    return parse_reply(reply, &open_path);
}

inline int notify_publish(const std::string &key)
{
    if (!cfg().cluster)
        return 0;
    if (key.find('\n') != std::string::npos)
        return EINVAL;
    std::string reply;
    if (int e = server_request("PUBLISH " + key + "\n", reply, reply_wait_ms()))
        return e;
    return parse_reply(reply, nullptr);
}

// Publish tmp as abs. The temp never survives. Returns 0 or errno.
inline int publish(const std::string &tmp, const std::string &abs, const std::string &key)
{
    if (cfg().fsync) {
        int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            ::fsync(fd);
            ::close(fd);
        }
    }
    if (cfg().overwrite) {
        if (::rename(tmp.c_str(), abs.c_str()) != 0) {
            int e = errno;
            ::unlink(tmp.c_str());
            return e;
        }
    } else {
        if (::link(tmp.c_str(), abs.c_str()) != 0) {
            int e = errno;
            ::unlink(tmp.c_str());
            return e;
        }
        ::unlink(tmp.c_str());
    }
    return notify_publish(key);
}

} // namespace detail

/// std::ifstream that consumes an instride key before opening it.
class ifstream : public std::ifstream {
  public:
    ifstream() = default;
    explicit ifstream(const std::string &path, std::ios_base::openmode mode = std::ios_base::in)
    {
        open(path, mode);
    }

    /// Wait for the key (bounded by INSTRIDE_TIMEOUT), then open it. On failure
    /// failbit is set and error() tells why.
    void open(const std::string &path, std::ios_base::openmode mode = std::ios_base::in)
    {
        err_ = 0;
        std::string abs, key, target = path;
        if (detail::managed(path, abs, key)) {
            if (mode & (std::ios_base::out | std::ios_base::app | std::ios_base::trunc)) {
                fail_with(EPERM); // published keys are immutable
                return;
            }
            if (int e = detail::consume(abs, key, target)) {
                fail_with(e);
                return;
            }
        }
        errno = 0;
        std::ifstream::open(target, mode);
        if (!is_open())
            err_ = errno ? errno : EIO;
    }

    /// errno of the last failed open (0 if it succeeded).
    int error() const noexcept { return err_; }

  private:
    void fail_with(int e)
    {
        err_ = e;
        setstate(std::ios_base::failbit);
    }
    int err_ = 0;
};

/// std::ofstream that writes a key under a temp name and publishes it on close().
class ofstream : public std::ofstream {
  public:
    ofstream() = default;
    explicit ofstream(const std::string &path, std::ios_base::openmode mode = std::ios_base::out)
    {
        open(path, mode);
    }
    ofstream(const ofstream &) = delete;
    ofstream &operator=(const ofstream &) = delete;
    ~ofstream() override
    {
        try {
            if (is_open() || managed_)
                close();
        } catch (...) { // exceptions() may make close() throw; never from a destructor
        }
    }

    /// Open a key for writing (a fresh temp file next to it), or any other path.
    void open(const std::string &path, std::ios_base::openmode mode = std::ios_base::out)
    {
        err_ = 0;
        std::string abs, key;
        if (!detail::managed(path, abs, key)) {
            errno = 0;
            std::ofstream::open(path, mode);
            if (!is_open())
                err_ = errno ? errno : EIO;
            return;
        }
        if ((mode & std::ios_base::app) || ((mode & std::ios_base::in) && !(mode & std::ios_base::trunc))) {
            fail_with(EPERM); // no append / in-place update of a key
            return;
        }
        struct stat st;
        if (!detail::cfg().overwrite && ::stat(abs.c_str(), &st) == 0) {
            fail_with(EEXIST); // write-once
            return;
        }
        if (int e = detail::mkdir_p(detail::dirname(abs))) {
            fail_with(e);
            return;
        }
        std::string tmp;
        int fd = -1;
        for (int tries = 0; tries < 8 && fd < 0; tries++) {
            tmp = detail::temp_name(abs);
            fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
            if (fd < 0 && errno != EEXIST)
                break;
        }
        if (fd < 0) {
            fail_with(errno);
            return;
        }
        ::close(fd);
        std::ofstream::open(tmp, mode | std::ios_base::trunc);
        if (!is_open()) {
            int e = errno ? errno : EIO;
            ::unlink(tmp.c_str());
            fail_with(e);
            return;
        }
        tmp_ = tmp;
        final_ = abs;
        key_ = key;
        managed_ = true;
    }

    /// Close; for a key, publish it. On failure failbit is set, error() tells
    /// why (EEXIST: the key was published meanwhile), and nothing is published.
    void close()
    {
        bool was_open = is_open();
        std::ofstream::close(); // flushes; sets failbit if that fails
        if (!managed_)
            return;
        managed_ = false;
        if (!was_open || fail()) {
            ::unlink(tmp_.c_str());
            if (err_ == 0)
                err_ = EIO;
            setstate(std::ios_base::failbit);
            return;
        }
        if (int e = detail::publish(tmp_, final_, key_))
            fail_with(e);
    }

    /// errno of the last failed open or close (0 if it succeeded).
    int error() const noexcept { return err_; }

  private:
    void fail_with(int e)
    {
        err_ = e;
        setstate(std::ios_base::failbit);
    }
    std::string tmp_, final_, key_;
    bool managed_ = false;
    int err_ = 0;
};

} // namespace instride

#endif // INSTRIDE_STREAM_HPP
