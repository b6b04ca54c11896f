// streams.cpp -- drives include/instride/stream.hpp (linked with libinstride.so) from pytest.
//   streams produce <path> <lines> [delay_ms]  write "line <i>" lines, publish on close
//   streams consume <path>                     wait for the key, print its content
//   streams eexist <path>                      opening a published key must fail EEXIST
//   streams append <path>                      std::ios::app on a key must fail EPERM
//   streams plain <path>                       non-managed path: a plain std::ofstream
//   streams refuse <r|w> <path> <errno>        opening must fail with that errno (prints message())
// Exit 0 on success; on failure print "ERRNO <n> <strerror>" to stderr, exit 3.
#include <instride/stream.hpp>

#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <sys/stat.h>
#include <thread>

static int fail(const char *what, int e)
{
    std::cerr << what << " ERRNO " << e << " " << std::strerror(e) << "\n";
    return 3;
}

static bool exists(const std::string &p)
{
    struct stat st;
    return ::stat(p.c_str(), &st) == 0;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    std::string cmd = argv[1], path = argv[2];
    if (cmd == "produce") {
        int lines = argc > 3 ? std::atoi(argv[3]) : 10;
        int delay = argc > 4 ? std::atoi(argv[4]) : 0;
        instride::ofstream out(path, std::ios::binary);
        if (!out)
            return fail("open", out.error());
        for (int i = 0; i < lines; i++) {
            out << "line " << i << "\n";
            if (delay && i % 100 == 0) {
                out.flush();
                if (exists(path)) // never visible before close()
                    return fail("visible-before-close", EPROTO);
                std::this_thread::sleep_for(std::chrono::milliseconds(delay));
            }
        }
        out.close();
        if (!out)
            return fail("close", out.error());
        if (!exists(path))
            return fail("not-published", ENOENT);
        return 0;
    }
    if (cmd == "consume") {
        instride::ifstream in(path, std::ios::binary);
        if (!in)
            return fail("open", in.error());
        std::cout << in.rdbuf();
        return 0;
    }
    if (cmd == "eexist") {
        instride::ofstream out(path);
        if (out || out.error() != EEXIST)
            return fail("expected EEXIST", out.error());
        return 0;
    }
    if (cmd == "append") {
        instride::ofstream out(path, std::ios::app);
        if (out || out.error() != EPERM)
            return fail("expected EPERM", out.error());
        return 0;
    }
    if (cmd == "refuse" && argc > 4) {
        std::string how = argv[2];
        path = argv[3];
        int want = std::atoi(argv[4]);
        if (how == "r") {
            instride::ifstream in(path);
            if (in || in.error() != want)
                return fail("refuse-r", in.error());
            std::cout << in.message() << "\n";
        } else {
            instride::ofstream out(path);
            if (out || out.error() != want)
                return fail("refuse-w", out.error());
            std::cout << out.message() << "\n";
        }
        return 0;
    }
    if (cmd == "plain") {
        instride::ofstream out(path);
        if (!out || !exists(path)) // a plain file exists as soon as it is opened
            return fail("plain", out.error());
        out << "plain\n";
        out.close();
        return out ? 0 : fail("plain-close", out.error());
    }
    return 2;
}
