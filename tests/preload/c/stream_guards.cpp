// stream_guards.cpp -- the guards of include/instride/stream.hpp, one scenario per run:
//   stream_guards hold <frame key>     an open ifstream holds a stream's frame (a shared flock a
//                                      bounded stream's producer must wait for); close() frees it
//   stream_guards reader <key>         open with ifstream, print "READY <size> <hash>", wait for a
//                                      line on stdin, read again from offset 0, print "AFTER ..."
//   stream_guards unwind <key>         an exception unwinding through an ofstream aborts the key
//   stream_guards fork <key>           a forked child leaving the ofstream's scope publishes nothing
//   stream_guards reopen <dir>         a second open() of an open stream fails and leaves it alone
//   stream_guards longrel <dir>        a key by a relative path too long to handle: refused
//   stream_guards throwing <dir>       with exceptions(failbit), an open that fails after the key
//                                      was taken (EMFILE) lets it go and says why; opens again
// Prints "PASS <scenario>" and exits 0, or the failed check and exits 1.
#include <instride/stream.hpp>

#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            std::cerr << "FAIL line " << __LINE__ << ": " #cond << " (errno " << errno << ")\n"; \
            return 1;                                                                      \
        }                                                                                  \
    } while (0)

static bool exists(const std::string &p)
{
    struct stat st;
    return ::lstat(p.c_str(), &st) == 0;
}

static bool empty_dir(const std::string &p)
{
    DIR *d = ::opendir(p.c_str());
    if (d == nullptr)
        return false;
    int n = 0;
    while (struct dirent *e = ::readdir(d))
        n += std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0;
    ::closedir(d);
    return n == 0;
}

static std::string content(const std::string &p)
{
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// What a bounded stream's producer does before it rewrites a retired frame's file.
static bool rewritable(const std::string &p)
{
    int fd = ::open(p.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return false;
    bool free = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    ::close(fd);
    return free;
}

static std::string slurp(std::istream &in)
{
    in.clear();
    in.seekg(0);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

static unsigned long hash(const std::string &s)
{
    unsigned long x = 1469598103934665603ul;
    for (unsigned char c : s)
        x = (x ^ c) * 1099511628211ul;
    return x;
}

static int hold(const std::string &key)
{
    {
        instride::ofstream out(key, std::ios::binary);
        out << "frame bytes";
        out.close();
        CHECK(out && exists(key));
    }
    instride::ifstream in(key, std::ios::binary);
    CHECK(in && in.is_open());
    CHECK(!rewritable(key)); // held while open
    std::string got((std::istreambuf_iterator<char>(in)), {});
    CHECK(got == "frame bytes");
    in.close();
    CHECK(rewritable(key)); // and freed by close()
    {
        instride::ifstream scoped(key, std::ios::binary);
        CHECK(scoped && !rewritable(key));
    }
    CHECK(rewritable(key)); // and by the destructor
    return 0;
}

static int reader(const std::string &key)
{
    instride::ifstream in(key, std::ios::binary);
    if (!in) {
        std::cerr << in.message() << "\n";
        return 2;
    }
    std::string a = slurp(in);
    std::cout << "READY " << a.size() << " " << hash(a) << std::endl;
    std::string line;
    std::getline(std::cin, line);
    std::string b = slurp(in);
    std::cout << "AFTER " << b.size() << " " << hash(b) << (a == b ? " same" : " changed")
              << std::endl;
    return 0;
}

static int unwind(const std::string &key)
{
    try {
        instride::ofstream out(key, std::ios::binary);
        out << "HEADER 1000 atoms\n";
        for (int i = 0; i < 1000; i++) {
            if (i == 3)
                throw std::runtime_error("simulation blew up");
            out << "atom " << i << "\n";
        }
        out.close();
    } catch (const std::runtime_error &) {
    }
    CHECK(!exists(key)); // nothing partial published
    instride::ofstream again(key, std::ios::binary);
    CHECK(again); // the retry is free to publish
    again << "whole\n";
    again.close();
    CHECK(again && content(key) == "whole\n");
    // A stream opened while an exception is in flight (in a destructor during unwinding)
    // still publishes on its own normal scope exit.
    struct inner {
        std::string k;
        ~inner()
        {
            instride::ofstream o(k);
            o << "from a destructor\n";
        }
    };
    try {
        inner guard{key + ".dtor"};
        throw std::runtime_error("unwinding");
    } catch (const std::runtime_error &) {
    }
    CHECK(content(key + ".dtor") == "from a destructor\n");
    return 0;
}

static int child_leaves(const std::string &key, pid_t *pid)
{
    instride::ofstream out(key);
    out << "part 1\n" << std::flush;
    *pid = fork();
    if (*pid == 0)
        return 7; // the child leaves the scope: the destructor runs in the child
    int status = 0;
    waitpid(*pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(!exists(key)); // the child published nothing
    out << "part 2\n";
    out.close();
    CHECK(out && out.error() == 0);
    CHECK(content(key) == "part 1\npart 2\n");
    return 0;
}

static int forked(const std::string &key)
{
    pid_t pid = -1;
    int rc = child_leaves(key, &pid);
    if (pid == 0)
        _exit(rc == 7 ? 0 : 1);
    return rc;
}

static int reopen(const std::string &dir)
{
    instride::ofstream out(dir + "/a.txt");
    out << "data for a\n";
    out.open(dir + "/b.txt");
    CHECK(out.fail() && out.is_open());
    CHECK(!exists(dir + "/b.txt"));
    out.clear();
    out << "more for a\n";
    out.close();
    CHECK(out && content(dir + "/a.txt") == "data for a\nmore for a\n");
    CHECK(!exists(dir + "/b.txt"));

    instride::ifstream in(dir + "/a.txt");
    CHECK(in);
    in.open(dir + "/a.txt"); // an open stream refuses a second open, keeps the first
    CHECK(in.fail() && in.is_open());
    in.clear();
    std::string got((std::istreambuf_iterator<char>(in)), {});
    CHECK(got == "data for a\nmore for a\n");
    return 0;
}

static int longrel(const std::string &dir)
{
    std::string comp(200, 'd');
    CHECK(chdir(dir.c_str()) == 0);
    char cwd[PATH_MAX];
    // as deep as the working directory can go and stay well under PATH_MAX
    while (getcwd(cwd, sizeof cwd) != nullptr && std::strlen(cwd) + 201 < PATH_MAX - 100) {
        ::mkdir(comp.c_str(), 0777);
        CHECK(chdir(comp.c_str()) == 0);
    }
    CHECK(getcwd(cwd, sizeof cwd) != nullptr);
    ::mkdir(comp.c_str(), 0777);
    ::mkdir((comp + "/" + comp).c_str(), 0777);
    // the kernel opens it (relative: no total limit); its absolute form is over PATH_MAX
    std::string rel = comp + "/" + comp + "/frame.bin";
    CHECK(std::strlen(cwd) + 1 + rel.size() >= PATH_MAX);
    CHECK(instride_is_key(rel.c_str()) == 1);
    instride::ofstream out(rel);
    CHECK(!out && out.error() == ENAMETOOLONG && !out.message().empty());
    CHECK(!exists(rel)); // not written in place
    CHECK(empty_dir(comp + "/" + comp)); // and no temp file beside it
    instride::ifstream in(rel);
    CHECK(!in && in.error() == ENAMETOOLONG);
    instride_writer *w = nullptr;
    CHECK(instride_create(rel.c_str(), 0, 0644, &w) == ENAMETOOLONG);
    CHECK(std::strstr(instride_last_error(), "too long") != nullptr);
    return 0;
}

// Take every free descriptor but one (the key's own open takes it: the std open then fails).
static void starve(rlimit &old)
{
    getrlimit(RLIMIT_NOFILE, &old);
    rlimit low = old;
    low.rlim_cur = 64;
    setrlimit(RLIMIT_NOFILE, &low);
    int top = -1, fd;
    while ((fd = dup(0)) >= 0)
        top = fd;
    ::close(top);
}

static int throwing(const std::string &dir)
{
    std::string in_key = dir + "/thrown-in.txt", out_key = dir + "/thrown-out.txt";
    {
        instride::ofstream o(in_key);
        o << "data\n";
    }
    rlimit old;
    instride::ifstream in;
    in.exceptions(std::ios::failbit);
    starve(old);
    bool threw = false;
    try {
        in.open(in_key);
    } catch (const std::ios_base::failure &) {
        threw = true;
    }
    setrlimit(RLIMIT_NOFILE, &old);
    CHECK(threw && !in.is_open() && in.error() != 0 && !in.message().empty());
    in.clear();
    in.open(in_key); // (the key was let go: not EBUSY)
    CHECK(in.is_open());
    std::string line;
    CHECK(std::getline(in, line) && line == "data");
    in.close();

    instride::ofstream out;
    out.exceptions(std::ios::failbit);
    starve(old);
    threw = false;
    try {
        out.open(out_key);
    } catch (const std::ios_base::failure &) {
        threw = true;
    }
    setrlimit(RLIMIT_NOFILE, &old);
    CHECK(threw && out.error() != 0);
    out.clear();
    out.open(out_key); // (the first temp was removed: the key opens afresh)
    CHECK(out.is_open());
    out << "x\n";
    out.close();
    struct stat st;
    CHECK(stat(out_key.c_str(), &st) == 0 && st.st_size == 2);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    std::string cmd = argv[1], arg = argv[2];
    int rc = cmd == "hold"      ? hold(arg)
             : cmd == "reader"  ? reader(arg)
             : cmd == "unwind"  ? unwind(arg)
             : cmd == "fork"    ? forked(arg)
             : cmd == "reopen"  ? reopen(arg)
             : cmd == "longrel" ? longrel(arg)
             : cmd == "throwing" ? throwing(arg)
                                : 2;
    if (rc == 0 && cmd != "reader")
        std::cout << "PASS " << cmd << std::endl;
    return rc;
}
