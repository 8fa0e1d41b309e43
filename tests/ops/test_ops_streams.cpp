// Tensors used on streams other than their allocation stream: the arena must learn of every such
// stream before the tensor is released, or the block is handed to the next owner while queued
// work still reads it. Stream handles are slots that are reused, so "already declared" must be
// remembered by stream id, never by pointer. Also: ebb_tensor_to_host_async enqueues nothing
// when it fails.
#include <atomic>
#include <cstring>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/stream.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

// Holds a stream until the flag it points at is set: "a late read", the stream's later work
// queued behind it. The host function waits on host memory only (no device work, no alloc).
void gate_fn(void *u) {
  auto *open = static_cast<std::atomic<int> *>(u);
  while (!open->load(std::memory_order_acquire)) {
  }
}

// Creates and releases streams of `device` until a new one has the handle `old` had (stream
// slots are reused first-in-first-out after 1024 releases), and returns it (live, caller owns).
ebb_stream_t *stream_reusing(int device, const ebb_stream_t *old) {
  for (int i = 0; i < 8192; i++) {
    ebb_stream_t *s = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(device, EBB_PRIO_LOW, &s));
    if (s == old) return s;
    EBB_REQUIRE_OK(ebb_stream_release(s));
  }
  FAIL("no new stream reused the released stream's handle in 8192 create/release cycles");
  return nullptr;
}

// The scenario: tensor `a` (2^20 f32 ones) was used on a stream `old` that is then released; a new
// stream gets old's handle and queues a late read of `a` (a clone behind a gate). `a` is released
// and a new tensor of the same size, written with 2s on the default stream, may take its block
// (were it handed over unordered after the late read, that read would see 2s in all 2^20
// elements). The late read must still see the ones. alloc_on_old: `a` was allocated on `old` itself (the
// allocation stream is remembered too), else on the default stream and only read on `old`.
void late_read_on_reused_stream(bool alloc_on_old) {
  const int dev = 0;
  const int64_t n = int64_t(1) << 20;
  ebb_stream_t *def = nullptr, *old = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(dev, &def));
  EBB_REQUIRE_OK(ebb_stream_create(dev, EBB_PRIO_LOW, &old));
  Tensor a, r;
  if (alloc_on_old) {
    EBB_REQUIRE_OK(ebb_stream_set_current(old));
    EBB_REQUIRE_OK(ebb_tensor_ones(dev, EBB_F32, 1, &n, a.out()));
  } else {
    EBB_REQUIRE_OK(ebb_tensor_ones(dev, EBB_F32, 1, &n, a.out()));
    EBB_REQUIRE_OK(ebb_stream_set_current(old));
    EBB_REQUIRE_OK(ebb_stream_wait_stream(old, def));
    EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 1.0, r.out())); // a read on `old`: declared to the arena
  }
  EBB_REQUIRE_OK(ebb_stream_synchronize(old));
  r.reset();
  EBB_REQUIRE_OK(ebb_stream_set_current(def));
  EBB_REQUIRE_OK(ebb_stream_release(old));

  ebb_stream_t *s = stream_reusing(dev, old); // a new stream (new id) with old's handle
  std::atomic<int> open{0};
  EBB_REQUIRE_OK(ebb_stream_set_current(s));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(s, def));
  EBB_REQUIRE_OK(ebb_stream_host_func(s, gate_fn, &open));
  Tensor late;
  EBB_REQUIRE_OK(ebb_tensor_clone(a, late.out())); // queued behind the gate: reads a later
  EBB_REQUIRE_OK(ebb_stream_set_current(def));
  void *aptr = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_data(a, &aptr));
  a.reset(); // the block goes back to the arena while the late read is still queued
  Tensor b;
  EBB_REQUIRE_OK(ebb_tensor_full(dev, EBB_F32, 1, &n, 2.0, b.out()));
  // The gate opens once b is written, or at once when b did not get a's block (then b cannot
  // be what the late read sees). A b that got the block with nothing ordering its write after
  // the gate would make that wait return. (No host function opens it: the emulated
  // driver runs a device's host functions one at a time, so one queued behind the gate would
  // never run.)
  void *bptr = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_data(b, &bptr));
  if (bptr != aptr) open.store(1, std::memory_order_release);
  ebb_event_t *written = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(dev, EBB_EVENT_DEFAULT, &written));
  EBB_REQUIRE_OK(ebb_event_record(written, def));
  EBB_REQUIRE_OK(ebb_event_synchronize(written));
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  EBB_REQUIRE_OK(ebb_event_release(written));
  std::vector<float> got((size_t)n);
  EBB_REQUIRE_OK(ebb_tensor_to_host(late, got.data(), got.size() * sizeof(float)));
  size_t wrong = 0;
  for (float x : got) wrong += x != 1.0f;
  INFO(wrong << " of " << n << " elements of the late read saw another tensor's data");
  CHECK(wrong == 0);
  late.reset();
  b.reset();
  EBB_REQUIRE_OK(ebb_stream_release(s));
}

} // namespace

TEST_CASE("tensor streams: a new stream with a released stream's handle is declared to the arena",
          "[ops][tensor][streams]") {
  EbbSession session;
  late_read_on_reused_stream(false);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor streams: a new stream with the released allocation stream's handle is declared to the arena",
          "[ops][tensor][streams]") {
  EbbSession session;
  late_read_on_reused_stream(true);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// tensor.h: "On failure nothing is enqueued and `done` is not recorded". Every refusal comes before
// the copy: a released event (device and CPU tensors alike: a CPU tensor is not copied, and the
// message names the user's call, never the internal ebb_event_device), an event of another
// device, pageable dst; dst keeps its bytes and the message names the call.
TEST_CASE("tensor streams: ebb_tensor_to_host_async copies nothing when it fails", "[ops][tensor][streams]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  const std::string fn = "ebb_tensor_to_host_async:";
  for (int dev : ebb_test_existing({EBB_DEVICE_CPU, 0, 1})) {
    INFO(dev_name(dev));
    auto v = values(35, 7);
    Tensor t = make(dev, EBB_F64, {5, 7}, v), tt;
    EBB_REQUIRE_OK(ebb_tensor_transpose(t, 0, 1, tt.out()));
    void *pin = nullptr;
    EBB_REQUIRE_OK(ebb_pinned_alloc(35 * 8, dev == EBB_DEVICE_CPU ? 0 : dev, &pin));
    std::memset(pin, 0x5a, 35 * 8);
    ebb_event_t *dead = nullptr, *other = nullptr;
    EBB_REQUIRE_OK(ebb_event_create(dev == EBB_DEVICE_CPU ? 0 : dev, EBB_EVENT_DEFAULT, &dead));
    EBB_REQUIRE_OK(ebb_event_release(dead));
    EBB_REQUIRE_OK(ebb_event_create(dev == 1 ? 0 : 1, EBB_EVENT_DEFAULT, &other));
    for (const ebb_tensor_t *src : {t.get(), tt.get()}) {
      EBB_CHECK_FAILS(ebb_tensor_to_host_async(src, pin, 35 * 8, dead), EBB_EFREED, "released");
      CHECK(std::string(ebb_last_error()).rfind(fn, 0) == 0);
      if (dev != EBB_DEVICE_CPU) {
        EBB_CHECK_FAILS(ebb_tensor_to_host_async(src, pin, 35 * 8, other), EBB_EDEVICE, "event done belongs to device");
        CHECK(std::string(ebb_last_error()).rfind(fn, 0) == 0);
        bool done = false;
        EBB_REQUIRE_OK(ebb_event_query(other, &done)); // never recorded: complete
        CHECK(done);
      }
    }
    if (dev != EBB_DEVICE_CPU) {
      ebb_stream_t *s = nullptr;
      EBB_REQUIRE_OK(ebb_stream_current(dev, &s));
      EBB_REQUIRE_OK(ebb_stream_synchronize(s)); // anything enqueued would have landed by now
    }
    if (dev != EBB_DEVICE_CPU) {
      // A pinned dst block too small for the tensor: refused before the contiguous copy of the
      // transposed view is made (no block allocated on the device, nothing enqueued).
      void *small = nullptr;
      EBB_REQUIRE_OK(ebb_pinned_alloc(16 * 8, dev, &small));
      ebb_event_t *ev = nullptr;
      EBB_REQUIRE_OK(ebb_event_create(dev, EBB_EVENT_DEFAULT, &ev));
      ebb_arena_stats before{}, after{};
      EBB_REQUIRE_OK(ebb_arena_get_stats(dev, &before));
      for (const ebb_tensor_t *src : {t.get(), tt.get()}) {
        EBB_CHECK_FAILS(ebb_tensor_to_host_async(src, small, 35 * 8, ev), EBB_EINVAL, "run past the end of its block");
        CHECK(std::string(ebb_last_error()).rfind(fn, 0) == 0);
      }
      EBB_REQUIRE_OK(ebb_arena_get_stats(dev, &after));
      CHECK(after.alloc_count == before.alloc_count);
      bool done = false;
      EBB_REQUIRE_OK(ebb_event_query(ev, &done)); // never recorded
      CHECK(done);
      EBB_REQUIRE_OK(ebb_event_release(ev));
      EBB_REQUIRE_OK(ebb_pinned_free(small));
    }
    const unsigned char *p = static_cast<const unsigned char *>(pin);
    size_t touched = 0;
    for (size_t i = 0; i < 35 * 8; i++) touched += p[i] != 0x5a;
    CHECK(touched == 0);
    EBB_REQUIRE_OK(ebb_event_release(other));
    EBB_REQUIRE_OK(ebb_pinned_free(pin));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

// From a host function, ebb_tensor_to_host_async must not take the arena's lock to check its
// pinned destination (a thread holding it may wait for that very function): the check refuses
// first, with EBB_ESTATE, and nothing is enqueued.
TEST_CASE("tensor streams: ebb_tensor_to_host_async from a host function is refused before the pools' lock",
          "[ops][tensor][streams][host_fn]") {
  EbbSession session;
  const int64_t n = 64;
  Tensor t;
  EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 1, &n, 3.0, t.out()));
  void *pin = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(n * 4, 0, &pin));
  std::memset(pin, 0, n * 4);
  ebb_event_t *ev = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &ev));
  ebb_stream_t *side = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &side));
  struct Ctx {
    ebb_tensor_t *t;
    void *pin;
    ebb_event_t *ev;
    ebb_status st;
    std::string msg;
  } c{t.get(), pin, ev, EBB_OK, ""};
  EBB_REQUIRE_OK(ebb_stream_host_func(
      side,
      [](void *u) {
        auto *x = static_cast<Ctx *>(u);
        x->st = ebb_tensor_to_host_async(x->t, x->pin, 64 * 4, x->ev);
        x->msg = x->st ? ebb_last_error() : "";
      },
      &c));
  EBB_REQUIRE_OK(ebb_stream_synchronize(side));
  INFO(c.msg);
  CHECK(c.st == EBB_ESTATE);
  CHECK(c.msg.rfind("ebb_tensor_to_host_async: ", 0) == 0);
  CHECK(c.msg.find("lies in the memory of the pinned") != std::string::npos);
  ebb_stream_t *cur = nullptr;
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
  EBB_REQUIRE_OK(ebb_stream_synchronize(cur));
  long touched = 0;
  for (int i = 0; i < n * 4; i++) touched += static_cast<unsigned char *>(pin)[i] != 0;
  CHECK(touched == 0);
  bool done = false;
  EBB_REQUIRE_OK(ebb_event_query(ev, &done));
  CHECK(done);  // never recorded
  EBB_REQUIRE_OK(ebb_event_release(ev));
  EBB_REQUIRE_OK(ebb_stream_release(side));
  EBB_REQUIRE_OK(ebb_pinned_free(pin));
  t.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}
