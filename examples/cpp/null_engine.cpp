// The `null` engine in C++ over the C ABI (docs/protocol.md §7.1): no physics; frame s
// holds the pattern of s in `obs`, and `rewards[e]` echoes `actions[e, 0]`, so a client
// can check every step. The C handles live in std::unique_ptr with the library's close
// and free as deleters, and a failing call becomes an exception carrying the library's
// message.
//
//   ./null_engine_cpp [--num-envs N] [--obs-dim D] [--act-dim A]
//
// Built with CMake against the installed library (examples/cpp/CMakeLists.txt,
// find_package(shmbridge)); follows the engine CLI convention (docs/protocol.md §9):
// prints the region name once frame 0 is published, serves until the client closes.
#include <shmbridge.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

namespace {

struct Error : std::runtime_error {
    shmb_status status;
    Error(shmb_status s, const std::string &what)
        : std::runtime_error(what + ": " + shmb_last_error_message() + " (" + shmb_status_name(s) + ")"),
          status(s) {}
};

void check(shmb_status s, const char *what) {
    if (s != SHMB_OK) throw Error(s, what);
}

struct SpecFree {
    void operator()(shmb_spec *spec) const { shmb_spec_free(spec); }
};
struct EngineClose {
    void operator()(shmb_engine *engine) const { shmb_engine_close(engine); }
};
using Spec = std::unique_ptr<shmb_spec, SpecFree>;
using Engine = std::unique_ptr<shmb_engine, EngineClose>;

// A tensor of the engine's region: the shared memory itself, valid until the engine closes.
template <typename T>
struct Tensor {
    T *data = nullptr;
    size_t len = 0;
};

template <typename T>
Tensor<T> tensor(shmb_engine *engine, const char *name) {
    void *data = nullptr;
    size_t bytes = 0;
    check(shmb_engine_tensor(engine, name, 0, &data, &bytes), name);
    return {static_cast<T *>(data), bytes / sizeof(T)};
}

float pattern(uint64_t seq, uint64_t index) {
    return static_cast<float>((seq * 2654435761ULL + index) & 0xFFFFFFULL);
}

volatile std::sig_atomic_t stop_signal = 0;
extern "C" void on_signal(int sig) { stop_signal = sig; }

int serve(uint32_t num_envs, uint64_t obs_dim, uint64_t act_dim) {
    Spec spec([&] {
        shmb_spec *s = nullptr;
        check(shmb_spec_new("null-cpp", num_envs, &s), "shmb_spec_new");
        return s;
    }());
    check(shmb_spec_add_standard(spec.get(), obs_dim, act_dim, SHMB_F32), "shmb_spec_add_standard");
    Engine engine([&] {
        shmb_engine *e = nullptr;
        check(shmb_engine_create(spec.get(), &e), "shmb_engine_create");
        return e;
    }());
    spec.reset();  // the engine keeps nothing of the spec

    auto obs = tensor<float>(engine.get(), "obs");
    auto actions = tensor<const float>(engine.get(), "actions");
    auto rewards = tensor<float>(engine.get(), "rewards");
    auto write_frame = [&](uint64_t seq) {
        for (size_t i = 0; i < obs.len; i++) obs.data[i] = pattern(seq, i);
    };
    write_frame(0);
    check(shmb_engine_publish(engine.get(), nullptr), "shmb_engine_publish");
    const char *name = nullptr;
    check(shmb_engine_name(engine.get(), &name), "shmb_engine_name");
    std::printf("%s\n", name);
    std::fflush(stdout);

    while (!stop_signal) {
        uint64_t seq = 0;
        shmb_status s = shmb_engine_wait_actions(engine.get(), 100, nullptr, &seq);
        if (s == SHMB_TIMEOUT) continue;
        if (s == SHMB_CLIENT_CLOSED) return 0;
        check(s, "shmb_engine_wait_actions");
        write_frame(seq);
        for (uint32_t e = 0; e < num_envs; e++) rewards.data[e] = actions.data[e * act_dim];
        check(shmb_engine_publish(engine.get(), nullptr), "shmb_engine_publish");
    }
    return 128 + stop_signal;
}

}  // namespace

int main(int argc, char **argv) {
    uint32_t num_envs = 1;
    uint64_t obs_dim = 16, act_dim = 1;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && std::strcmp(argv[i], "--num-envs") == 0) num_envs = std::strtoul(argv[++i], nullptr, 10);
        else if (i + 1 < argc && std::strcmp(argv[i], "--obs-dim") == 0) obs_dim = std::strtoull(argv[++i], nullptr, 10);
        else if (i + 1 < argc && std::strcmp(argv[i], "--act-dim") == 0) act_dim = std::strtoull(argv[++i], nullptr, 10);
        else {
            std::fprintf(stderr, "usage: %s [--num-envs N] [--obs-dim D] [--act-dim A]\n", argv[0]);
            return 2;
        }
    }
    if (shmb_abi_version() != SHMB_ABI_VERSION) {
        std::fprintf(stderr, "null_engine_cpp: built for ABI %d, the loaded library has ABI %u\n",
                     SHMB_ABI_VERSION, shmb_abi_version());
        return 1;
    }
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    try {
        return serve(num_envs, obs_dim, act_dim);
    } catch (const Error &e) {
        std::fprintf(stderr, "null_engine_cpp: %s\n", e.what());
        return 1;
    }
}
