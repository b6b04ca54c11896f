// instride/stream.hpp -- C++17 file streams that take part in instride: a thin RAII
// layer over the C API of instride/instride.h (libinstride.so), with no protocol
// logic of its own.
//
//   instride::ofstream out(dir + "/run7/frame_000042.bin", std::ios::binary);
//   out.write(buf, n);
//   out.close();                 // publishes: the key appears, complete, at once
//
//   instride::ifstream in(dir + "/run7/frame_000042.bin", std::ios::binary);
//   if (!in) std::cerr << in.message() << "\n";   // in.error() == ETIMEDOUT, ...
//
// Build: c++ -std=c++17 prog.cpp $(instride preload-path --cflags --libs)
//
// * A path under the managed directory (INSTRIDE_DIR) is a key (instride_is_key),
//   also one too long to handle (refused: ENAMETOOLONG, never written as a plain file).
//   Any other path behaves exactly like std::*fstream.
// * ofstream writes to a hidden temp file next to the key (instride_create) and
//   close() publishes it (instride_commit): write-once (EEXIST if the key exists)
//   unless INSTRIDE_OVERWRITE=1. An explicit close() or a normal scope exit
//   publishes; a destructor run by an exception unwinding through the stream's
//   scope aborts (the temp is removed, nothing is published: the retry is free).
//   In a forked child the stream is the parent's: its close() or destructor
//   publishes nothing (EPERM) and leaves the parent's temp alone (flush before
//   fork(), as with any stdio stream: what is still buffered is written twice).
//   Appending (std::ios::app) or updating (in without trunc) a key: EPERM.
// * ifstream waits for the key up to INSTRIDE_TIMEOUT seconds and opens it
//   (instride_open_read: confined, no symbolic link followed); in cluster mode the
//   node server makes it local first. While open it holds the file as the C API
//   does: a stream's frame (frame_<9 digits>.isf) is not recycled by a bounded
//   stream's producer under it. The stream reads the key through
//   /proc/self/fd/<fd> (the same open file, no second path lookup).
//   INSTRIDE_TIMEOUT unset, empty or inf: forever; 0: do not wait (a key not yet
//   published fails at once with ETIMEDOUT); negative: refused (EINVAL).
// * open() on a stream that is open fails (failbit, error() EBUSY), as std:: does,
//   leaving the open key alone; as after any failure, an ofstream's close() with failbit
//   set discards the key: clear() first to publish it.
// * Failures set failbit (which throws if you enabled exceptions()); error() returns
//   the errno (ETIMEDOUT, EEXIST, EPERM, ELOOP, EINVAL, ECONNREFUSED, ...; the list is
//   in docs/preload.md) and message() instride's message naming the key.
//
// open() and close() hide, not override, the std:: members: call them on an
// instride stream, not through a std::ofstream& to it.
#ifndef INSTRIDE_STREAM_HPP
#define INSTRIDE_STREAM_HPP

#include <instride/instride.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <exception>
#include <memory>
#include <string>
#include <unistd.h>

namespace instride {
namespace detail {

struct writer_abort {
    void operator()(instride_writer *w) const noexcept { instride_abort(w); }
};
using writer_ptr = std::unique_ptr<instride_writer, writer_abort>;

// The error state every instride stream keeps: errno and message of the last failure.
class status {
  public:
    int error() const noexcept { return err_; }
    const std::string &message() const noexcept { return msg_; }

  protected:
    void clear_status() noexcept
    {
        err_ = 0;
        msg_.clear();
    }
    // An instride call failed with e: keep its message.
    void set_status(int e)
    {
        err_ = e;
        const char *m = instride_last_error();
        msg_ = (m != nullptr && *m) ? m : std::string("instride: ") + instride_strerror(e);
    }
    // A libc/stdio failure (errno may be 0: then EIO).
    void set_status_errno(const char *what)
    {
        err_ = errno ? errno : EIO;
        msg_ = std::string(what) + ": " + std::strerror(err_);
    }
    // open() on a stream that is open: refused as std:: refuses it, the open file untouched.
    void set_status_busy()
    {
        err_ = EBUSY;
        msg_ = "instride: the stream is already open (close it first)";
    }

  private:
    int err_ = 0;
    std::string msg_;
};

} // namespace detail

/// std::ifstream that consumes an instride key before opening it.
class ifstream : public std::ifstream, public detail::status {
  public:
    ifstream() = default;
    explicit ifstream(const std::string &path, std::ios_base::openmode mode = std::ios_base::in)
    {
        open(path, mode);
    }
    ifstream(const ifstream &) = delete; // (owns fd_; no implicit move either)
    ifstream &operator=(const ifstream &) = delete;
    ~ifstream() override
    {
        try {
            if (is_open())
                std::ifstream::close();
        } catch (...) { // exceptions() may make close() throw; never from a destructor
        }
        release();
    }

    /// Wait for the key (bounded by INSTRIDE_TIMEOUT; 0: no wait), then open it and hold it
    /// until close(). On failure failbit is set and error()/message() tell why.
    void open(const std::string &path, std::ios_base::openmode mode = std::ios_base::in)
    {
        if (is_open() || fd_ >= 0) {
            set_status_busy();
            setstate(std::ios_base::failbit);
            return;
        }
        clear_status();
        std::string target = path;
        if (instride_is_key(path.c_str())) {
            if (mode & (std::ios_base::out | std::ios_base::app | std::ios_base::trunc)) {
                errno = EPERM; // published keys are immutable
                set_status_errno("instride: an instride::ifstream cannot write a key");
                setstate(std::ios_base::failbit);
                return;
            }
            // The C API opens the key confined and, for a stream's frame, holds it (a shared
            // flock that lives as long as this fd): kept until close(). The stream reads the
            // same open file through /proc, never the key's path again.
            int fd = -1;
            if (int e = instride_open_read(path.c_str(), &fd)) {
                set_status(e);
                setstate(std::ios_base::failbit);
                return;
            }
            fd_ = fd;
            target = "/proc/self/fd/" + std::to_string(fd);
        }
        errno = 0;
        try { // (exceptions() may make a failed open throw: the held key goes all the same)
            std::ifstream::open(target, mode);
        } catch (...) {
            set_status_errno(fd_ >= 0 ? (path + " (through " + target + ")").c_str()
                                      : target.c_str());
            release();
            throw;
        }
        if (!is_open()) {
            set_status_errno(fd_ >= 0 ? (path + " (through " + target + ")").c_str()
                                      : target.c_str());
            release();
        }
    }

    /// Close, and let go of the key (a stream's frame may then be recycled).
    void close()
    {
        try {
            std::ifstream::close();
        } catch (...) { // (exceptions() enabled: the key is let go of all the same)
            release();
            throw;
        }
        release();
    }

  private:
    void release() noexcept
    {
        if (fd_ >= 0) {
            int saved = errno;
            ::close(fd_);
            errno = saved;
            fd_ = -1;
        }
    }

    int fd_ = -1; // the key's fd from instride_open_read, held while open (-1: none)
};

/// std::ofstream that writes a key under a temp name and publishes it on close().
class ofstream : public std::ofstream, public detail::status {
  public:
    ofstream() = default;
    explicit ofstream(const std::string &path, std::ios_base::openmode mode = std::ios_base::out)
    {
        open(path, mode);
    }
    ofstream(const ofstream &) = delete;
    ofstream &operator=(const ofstream &) = delete;
    /// Publishes (as close()) on a normal scope exit; while an exception that was not in
    /// flight at open() unwinds through the scope, aborts: nothing partial is published.
    ~ofstream() override
    {
        try {
            if (writer_ && std::uncaught_exceptions() > exceptions_at_open_) {
                std::ofstream::close(); // (its last bytes go to the temp file, then removed)
                writer_.reset();        // aborts: the temp file is removed
            } else if (is_open() || writer_) {
                close();
            }
        } catch (...) { // exceptions() may make close() throw; never from a destructor
        }
    }

    /// Open a key for writing (a fresh temp file next to it), or any other path.
    /// On a stream that is open: failbit (error() EBUSY), the open key left alone.
    void open(const std::string &path, std::ios_base::openmode mode = std::ios_base::out)
    {
        if (is_open() || writer_) {
            set_status_busy();
            setstate(std::ios_base::failbit);
            return;
        }
        clear_status();
        exceptions_at_open_ = std::uncaught_exceptions();
        if (!instride_is_key(path.c_str())) {
            errno = 0;
            std::ofstream::open(path, mode);
            if (!is_open())
                set_status_errno(path.c_str());
            return;
        }
        if ((mode & std::ios_base::app) ||
            ((mode & std::ios_base::in) && !(mode & std::ios_base::trunc))) {
            errno = EPERM; // no append / in-place update of a key
            set_status_errno("instride: published keys are immutable (no append or update)");
            setstate(std::ios_base::failbit);
            return;
        }
        instride_writer *w = nullptr;
        if (int e = instride_create(path.c_str(), 0, 0666, &w)) {
            set_status(e);
            setstate(std::ios_base::failbit);
            return;
        }
        writer_.reset(w);
        errno = 0;
        try { // (exceptions() may make a failed open throw: the key's temp goes all the same)
            std::ofstream::open(instride_writer_path(w), mode | std::ios_base::trunc);
        } catch (...) {
            set_status_errno(instride_writer_path(w));
            writer_.reset(); // aborts: the temp file is removed
            throw;
        }
        if (!is_open()) {
            set_status_errno(instride_writer_path(w));
            writer_.reset(); // aborts: the temp file is removed
            setstate(std::ios_base::failbit);
        }
    }

    /// Close; for a key, publish it. On failure failbit is set, error() tells why
    /// (EEXIST: the key was published meanwhile), and nothing is published.
    void close()
    {
        bool was_open = is_open();
        std::ofstream::close(); // flushes; sets failbit if that fails
        if (!writer_)
            return;
        if (!was_open || fail()) {
            writer_.reset(); // aborts: nothing is published
            if (error() == 0) {
                errno = EIO;
                set_status_errno("instride: writing the key failed, nothing was published");
            }
            setstate(std::ios_base::failbit);
            return;
        }
        if (int e = instride_commit(writer_.release())) { // frees the writer either way
            set_status(e);
            setstate(std::ios_base::failbit);
        }
    }

  private:
    detail::writer_ptr writer_;
    int exceptions_at_open_ = 0; // std::uncaught_exceptions() at open(): more at destruction
                                 // means an exception unwinds through the stream's scope
};

} // namespace instride

#endif // INSTRIDE_STREAM_HPP
