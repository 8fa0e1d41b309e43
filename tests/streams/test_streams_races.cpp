// Misuse that must be reported, not crash or hang: calls racing ebb_stream_release of their
// stream on another thread, stale handles whose slot a new stream takes, and a host function
// that copies pageable memory. The races are meant to run under TSan as well.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "sanitizers.hpp"
#include "streams_test_util.hpp"

using namespace streams_test;

namespace {

void noop_host_fn(void *) {}

} // namespace

// A thread issues every kind of call on a created stream while the main thread releases it.
// Each call must succeed (it came first) or answer EBB_EFREED (the release came first); none may
// reach the driver stream the release destroys (which answered EBB_EINVAL with the driver's
// message, and is a data race on the driver handle under TSan).
TEST_CASE("races: calls on a stream racing its release succeed or get EBB_EFREED", "[streams][threads]") {
  EbbSession session;
  const bool kernels = cpu_kernels();
  Kernels k;
  std::atomic<long> ran{0};
  DevBuf dev(0, 4096);
  PinnedBuf pinned(4096);
  std::vector<unsigned char> pageable(4096, 7);
  ebb_stream_t *p = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &p));
  ebb_event_t *e = nullptr, *other = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &other));
  EBB_REQUIRE_OK(ebb_event_record(other, p));
  constexpr int kCalls = 12;
  const int rounds = kSanitized ? 150 : 600;
  int freed = 0;
  for (int round = 0; round < rounds; round++) {
    ebb_stream_t *s = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    std::atomic<long> issued{0};
    ebb_status bad = EBB_OK;
    std::string bad_msg;
    int bad_call = -1;
    std::thread user([&] {
      IncArgs ia{&ran};
      for (long i = 0;; i++) {
        const int call = int((i + round) % kCalls);
        ebb_status st = EBB_OK;
        bool idle = false;
        struct CUstream_st *cu = nullptr;
        switch (call) {
        case 0: st = ebb_event_record(e, s); break;
        case 1: st = kernels ? ebb_stream_launch(s, k.inc, &ia, nullptr) : ebb_event_record(e, s); break;
        case 2: st = ebb_event_wait(other, s); break;
        case 3: st = ebb_stream_host_func(s, noop_host_fn, nullptr); break;
        case 4: st = ebb_copy_async(dev.p(), pinned.ptr, 256, s); break;
        case 5: st = ebb_copy_async(dev.p(), pageable.data(), 256, s); break;
        case 6: st = ebb_stream_wait_stream(s, p); break;
        case 7: st = ebb_stream_wait_stream(p, s); break;
        case 8: st = ebb_stream_query(s, &idle); break;
        case 9: st = ebb_stream_synchronize(s); break;
        case 10: st = ebb_stream_cu(s, &cu); break;
        default: st = ebb_copy_async(pinned.ptr, dev.p(), 256, s); break;
        }
        if (st != EBB_OK) {
          bad = st;
          bad_msg = ebb_last_error();
          bad_call = call;
          return;
        }
        issued.fetch_add(1, std::memory_order_release);
      }
    });
    // Release at a different point of the cycle each round.
    while (issued.load(std::memory_order_acquire) < round % 29) std::this_thread::yield();
    EBB_REQUIRE_OK(ebb_stream_release(s));
    user.join();
    // The released stream's copies still run, and the next round's stream copies between the
    // same buffers: without this wait the two rounds' copies race on them (as a user's would).
    EBB_REQUIRE_OK(ebb_dev_synchronize(0));
    INFO("round " << round << ", call " << bad_call << ": " << ebb_status_name(bad) << ": " << bad_msg);
    REQUIRE(bad == EBB_EFREED);
    CHECK(bad_msg.find("released") != std::string::npos);
    freed++;
  }
  CHECK(freed == rounds);
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  EBB_REQUIRE_OK(ebb_event_release(e));
  EBB_REQUIRE_OK(ebb_event_release(other));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A stale handle asked about on one thread while another thread creates the stream that takes
// its slot: the EFREED message names the released stream and reads nothing the new stream
// writes (it read the slot's id and device, a data race under TSan). The flag between the
// threads is relaxed on purpose, so it orders nothing TSan could see. A plain read of the slot
// fails here through TSan's report (the tsan preset); the other presets check only the message,
// which such a read also gets right whenever the threads do not overlap.
TEST_CASE("races: a stale handle's EFREED message never reads a slot a new stream is taking", "[streams][threads]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &s));
  uint64_t id = 0;
  EBB_REQUIRE_OK(ebb_stream_id(s, &id));
  EBB_REQUIRE_OK(ebb_stream_release(s));
  churn_streams(1, 1024);
  std::atomic<int> asked{0};
  std::string msg;
  ebb_status st = EBB_OK;
  std::thread stale([&] {
    uint64_t x = 0;
    for (int i = 0; i < 3; i++) st = ebb_stream_id(s, &x);
    msg = ebb_last_error();
    asked.store(1, std::memory_order_relaxed);
  });
  while (!asked.load(std::memory_order_relaxed)) std::this_thread::yield();
  ebb_stream_t *n = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_HIGH, &n));
  stale.join();
  CHECK(n == s); // the new stream took the stale handle's slot
  CHECK(st == EBB_EFREED);
  CHECK(msg.find("stream " + std::to_string(id) + " (device 1)") != std::string::npos);
  // Released again, the slot names its latest stream.
  uint64_t nid = 0;
  EBB_REQUIRE_OK(ebb_stream_id(n, &nid));
  EBB_REQUIRE_OK(ebb_stream_release(n));
  EBB_CHECK_FAILS(ebb_stream_synchronize(s), EBB_EFREED, "stream " + std::to_string(nid) + " (device 1)");
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The same for events.
TEST_CASE("races: a stale event handle's EFREED message never reads a slot a new event is taking", "[streams][threads]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_event_t *e = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(1, EBB_EVENT_DEFAULT, &e));
  // Events have no id getter: the message of the released handle names it.
  EBB_REQUIRE_OK(ebb_event_release(e));
  bool done = false;
  ebb_clear_error();
  REQUIRE(ebb_event_query(e, &done) == EBB_EFREED);
  const std::string first = ebb_last_error();
  for (int i = 0; i < 1024; i++) {
    ebb_event_t *t = nullptr;
    EBB_REQUIRE_OK(ebb_event_create(1, EBB_EVENT_DEFAULT, &t));
    EBB_REQUIRE_OK(ebb_event_release(t));
  }
  std::atomic<int> asked{0};
  std::string msg;
  std::thread stale([&] {
    bool d = false;
    for (int i = 0; i < 3; i++) ebb_event_query(e, &d);
    msg = ebb_last_error();
    asked.store(1, std::memory_order_relaxed);
  });
  while (!asked.load(std::memory_order_relaxed)) std::this_thread::yield();
  ebb_event_t *n = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(1, EBB_EVENT_TIMING, &n));
  stale.join();
  CHECK(n == e);
  CHECK(msg == first);
  EBB_REQUIRE_OK(ebb_event_release(n));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A host function copying pageable memory: the staging chunk it needs is free only after work
// queued behind the host function itself (a stream waiting for it, then a staged copy on that
// stream with a ring of one chunk), so a copy that waited for the chunk would wait for ever on
// the host. It must fail
// at once with EBB_ESTATE and say why. A pinned copy from a host function is refused too: CUDA
// forbids driver calls there, so it fails on a GPU however ebb would enqueue it.
TEST_CASE("host functions: a pageable copy from a host function fails instead of deadlocking", "[streams][copy]") {
  ScopedEnv one_chunk("EBB_STAGING_CHUNKS", "1");
  EbbSession session;
  ebb_stream_t *s = nullptr, *t = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &t));
  DevBuf dev(0, 8192);
  PinnedBuf pinned(4096);
  std::vector<unsigned char> pageable(4096, 3), pageable2(4096, 5);
  struct Ctx {
    ebb_stream_t *s = nullptr;
    void *dev = nullptr;
    void *pinned = nullptr;
    unsigned char *pageable = nullptr;
    ebb_status pageable_st = EBB_OK, pinned_st = EBB_EINTERNAL;
    std::string msg, pinned_msg;
    std::atomic<int> ran{0};
  } ctx;
  ctx.s = s;
  ctx.dev = dev.p();
  ctx.pinned = pinned.ptr;
  ctx.pageable = pageable.data();
  std::atomic<int> open{0};
  EBB_REQUIRE_OK(ebb_stream_host_func(s, gate_host_fn, &open));
  EBB_REQUIRE_OK(ebb_stream_host_func(
      s,
      [](void *u) {
        auto *c = static_cast<Ctx *>(u);
        c->pageable_st = ebb_copy_async(c->dev, c->pageable, 4096, c->s);
        c->msg = ebb_last_error();
        c->pinned_st = ebb_copy_async(static_cast<char *>(c->dev) + 4096, c->pinned, 4096, c->s);
        c->pinned_msg = ebb_last_error();
        c->ran.store(1, std::memory_order_release);
      },
      &ctx));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(t, s)); // t runs after the host function...
  EBB_REQUIRE_OK(ebb_copy_async(dev.p(), pageable2.data(), 4096, t)); // ...and holds the only chunk
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(t));
  REQUIRE(ctx.ran.load(std::memory_order_acquire) == 1);
  INFO(ctx.msg);
  CHECK(ctx.pageable_st == EBB_ESTATE);
  CHECK(ctx.msg.find("host function") != std::string::npos);
  CHECK(ctx.msg.find("must not make driver calls") != std::string::npos);
  CHECK(ctx.pinned_st == EBB_ESTATE);
  CHECK(ctx.pinned_msg.find("must not make driver calls") != std::string::npos);
  // Outside a host function the same thread-local state is clear: pageable copies work.
  EBB_REQUIRE_OK(ebb_copy_async(dev.p(), pageable.data(), 4096, s));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  EBB_REQUIRE_OK(ebb_stream_release(s));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Every call of stream.h that would reach the driver refuses to run in a host function, on every
// driver (CUDA: "must not make any CUDA API calls"), naming the call and the stream; nothing is
// enqueued, and the same calls work from the host thread afterwards.
TEST_CASE("host functions: driver-reaching stream calls from a host function are EBB_ESTATE", "[streams][host_fn]") {
  EbbSession session;
  ebb_stream_t *s = nullptr, *t = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &t));
  ebb_event_t *e = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
  struct Ctx {
    ebb_stream_t *t;
    ebb_event_t *e;
    std::vector<std::pair<ebb_status, std::string>> got;
  } ctx{t, e, {}};
  EBB_REQUIRE_OK(ebb_stream_host_func(
      s,
      [](void *u) {
        auto *c = static_cast<Ctx *>(u);
        auto note = [c](ebb_status st) { c->got.emplace_back(st, st ? ebb_last_error() : ""); };
        bool idle = false;
        note(ebb_event_record(c->e, c->t));
        note(ebb_stream_wait_stream(c->t, c->t));  // the same stream: a no-op, no driver call
        note(ebb_stream_host_func(c->t, noop_host_fn, nullptr));
        note(ebb_stream_query(c->t, &idle));
        note(ebb_stream_synchronize(c->t));
        note(ebb_event_synchronize(c->e));
        note(ebb_stream_release(c->t));
      },
      &ctx));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  const char *calls[] = {"ebb_event_record", "ebb_stream_wait_stream", "ebb_stream_host_func", "ebb_stream_query",
                         "ebb_stream_synchronize", "ebb_event_synchronize", "ebb_stream_release"};
  REQUIRE(ctx.got.size() == 7);
  for (size_t i = 0; i < 7; i++) {
    INFO(calls[i] << " -> " << ebb_status_name(ctx.got[i].first) << ": " << ctx.got[i].second);
    if (i == 1) {
      CHECK(ctx.got[i].first == EBB_OK);  // waiting on itself: no driver call at all
      continue;
    }
    CHECK(ctx.got[i].first == EBB_ESTATE);
    CHECK(ctx.got[i].second.rfind(std::string(calls[i]) + ": ", 0) == 0);
    CHECK(ctx.got[i].second.find("host function") != std::string::npos);
  }
  bool done = false;
  EBB_REQUIRE_OK(ebb_event_query(e, &done));  // never recorded
  CHECK(done);
  EBB_REQUIRE_OK(ebb_event_record(e, t));
  EBB_REQUIRE_OK(ebb_event_release(e));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}
