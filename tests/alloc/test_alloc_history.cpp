// Owners, history and snapshots through ebb/alloc.h: owner scopes and their misuse, the actions
// the engine records with their owners, the snapshot JSON checked against ebb_arena_get_stats,
// the ring keeping the newest N, history:0, and the oom_snapshot file with the OOM report's top
// owners. The history settings are read once per process, so this file builds four executables
// (see CMakeLists.txt); EBB_HIST_MODE picks the cases each one holds.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <vector>

#include "alloc_test_util.hpp"
#include "ebb/trace.h"

using namespace alloc_test;

#define EBB_HIST_DEFAULT 0 /* default settings: scopes, actions, snapshot */
#define EBB_HIST_WRAP 1    /* EBB_ALLOC_CONF=history:64 */
#define EBB_HIST_OFF 2     /* EBB_ALLOC_CONF=history:0 */
#define EBB_HIST_OOM 3     /* EBB_SIM_MEM=128M, EBB_ALLOC_CONF=oom_snapshot:EBB_HIST_OOM_PATH */
#ifndef EBB_HIST_MODE
#define EBB_HIST_MODE EBB_HIST_DEFAULT
#endif

namespace {
// [[maybe_unused]] below: each EBB_HIST_MODE build uses a different subset of these helpers.

// ---- a small JSON reader: enough to check the snapshot is well formed and to walk it ----------

struct Json {
  enum Kind { Null, Bool, Num, Str, Arr, Obj } kind = Null;
  bool b = false;
  bool neg = false;  // numbers: sign and magnitude (addresses need all 64 bits)
  unsigned long long u = 0;
  std::string s;
  std::vector<Json> arr;
  std::map<std::string, Json> obj;
  const Json &operator[](const std::string &k) const {
    static const Json none;
    auto it = obj.find(k);
    return it == obj.end() ? none : it->second;
  }
  bool has(const std::string &k) const { return obj.count(k) != 0; }
};

struct JsonReader {
  const std::string &t;
  size_t i = 0;
  std::string err;
  explicit JsonReader(const std::string &text) : t(text) {}
  void ws() {
    while (i < t.size() && (t[i] == ' ' || t[i] == '\n' || t[i] == '\t' || t[i] == '\r')) i++;
  }
  bool fail(const char *what) {
    if (err.empty()) err = std::string(what) + " at offset " + std::to_string(i);
    return false;
  }
  bool lit(const char *w) {
    size_t n = strlen(w);
    if (t.compare(i, n, w) != 0) return fail("bad literal");
    i += n;
    return true;
  }
  bool str(std::string &out) {
    if (i >= t.size() || t[i] != '"') return fail("expected string");
    for (i++; i < t.size() && t[i] != '"'; i++) {
      unsigned char c = (unsigned char)t[i];
      if (c < 0x20) return fail("control character in string");
      if (c == '\\') {
        if (++i >= t.size()) return fail("unterminated escape");
        char e = t[i];
        if (e == 'u') {
          if (i + 4 >= t.size()) return fail("short \\u escape");
          out += (char)std::stoi(t.substr(i + 1, 4), nullptr, 16);
          i += 4;
        } else if (strchr("\"\\/bfnrt", e)) {
          out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
        } else {
          return fail("bad escape");
        }
      } else {
        out += (char)c;
      }
    }
    if (i >= t.size()) return fail("unterminated string");
    i++;
    return true;
  }
  bool value(Json &v) {
    ws();
    if (i >= t.size()) return fail("unexpected end");
    char c = t[i];
    if (c == '{') {
      v.kind = Json::Obj;
      i++;
      ws();
      if (i < t.size() && t[i] == '}') return ++i, true;
      for (;;) {
        ws();
        std::string k;
        if (!str(k)) return false;
        ws();
        if (i >= t.size() || t[i++] != ':') return fail("expected ':'");
        if (!value(v.obj[k])) return false;
        ws();
        if (i < t.size() && t[i] == ',') {
          i++;
          continue;
        }
        if (i < t.size() && t[i] == '}') return ++i, true;
        return fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind = Json::Arr;
      i++;
      ws();
      if (i < t.size() && t[i] == ']') return ++i, true;
      for (;;) {
        v.arr.emplace_back();
        if (!value(v.arr.back())) return false;
        ws();
        if (i < t.size() && t[i] == ',') {
          i++;
          continue;
        }
        if (i < t.size() && t[i] == ']') return ++i, true;
        return fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.kind = Json::Str;
      return str(v.s);
    }
    if (c == 't') return v.kind = Json::Bool, v.b = true, lit("true");
    if (c == 'f') return v.kind = Json::Bool, lit("false");
    if (c == 'n') return lit("null");
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Json::Num;
      if (c == '-') v.neg = true, i++;
      size_t s = i;
      while (i < t.size() && t[i] >= '0' && t[i] <= '9') i++;
      if (s == i) return fail("bad number");
      v.u = std::stoull(t.substr(s, i - s));
      if (i < t.size() && (t[i] == '.' || t[i] == 'e' || t[i] == 'E')) return fail("the snapshot has only integers");
      return true;
    }
    return fail("unexpected character");
  }
  bool document(Json &v) {
    if (!value(v)) return false;
    ws();
    return i == t.size() || fail("trailing text");
  }
};

[[maybe_unused]] std::string slurp(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

[[maybe_unused]] Json parse_file(const std::string &path) {
  std::string text = slurp(path);
  REQUIRE(!text.empty());
  Json v;
  JsonReader r(text);
  bool ok = r.document(v);
  INFO(path << ": " << r.err);
  REQUIRE(ok);
  // A second opinion when Python is around (it is optional on build machines).
  if (std::system("python3 -c 'pass' >/dev/null 2>&1") == 0)
    CHECK(std::system(("python3 -m json.tool '" + path + "' >/dev/null").c_str()) == 0);
  return v;
}

[[maybe_unused]] std::string tmp_path(const char *name) {
  return std::string(EBB_HIST_TMPDIR) + "/" + name + "-" + std::to_string(getpid()) + ".json";
}

[[maybe_unused]] std::vector<ebb_alloc_trace_entry> history(int dev, uint64_t *total = nullptr) {
  size_t n = 0;
  EBB_REQUIRE_OK(ebb_alloc_history_get(dev, nullptr, 0, &n, total));
  std::vector<ebb_alloc_trace_entry> v(n);
  size_t got = 0;
  EBB_REQUIRE_OK(ebb_alloc_history_get(dev, v.data(), v.size(), &got, total));
  REQUIRE(got == n);
  return v;
}

// Segments' and blocks' totals of one device in a snapshot, to hold against the stats.
struct SnapTotals {
  uint64_t reserved = 0, allocated = 0, active = 0, requested = 0, segments = 0;
};

[[maybe_unused]] SnapTotals totals(const Json &snap, int dev) {
  SnapTotals t;
  for (const Json &g : snap["segments"].arr) {
    if ((int)g["device"].u != dev) continue;
    t.segments++;
    t.reserved += g["total_size"].u;
    uint64_t seg_alloc = 0, sum = 0;
    for (const Json &b : g["blocks"].arr) {
      sum += b["size"].u;
      if (b["state"].s == "active_allocated") {
        t.allocated += b["size"].u;
        t.requested += b["requested_size"].u;
        seg_alloc += b["size"].u;
      }
      if (b["state"].s != "inactive") t.active += b["size"].u;
    }
    CHECK(sum == g["total_size"].u);  // blocks tile their segment
    CHECK(seg_alloc == g["allocated_size"].u);
  }
  return t;
}

}  // namespace

#if EBB_HIST_MODE == EBB_HIST_DEFAULT

TEST_CASE("owner scopes nest, and misuse is reported without changing the stack", "[alloc][history]") {
  CHECK(std::string(ebb_owner_cat_name(EBB_OWNER_OTHER)) == "other");
  CHECK(std::string(ebb_owner_cat_name(EBB_OWNER_PARAMETER)) == "parameter");
  CHECK(std::string(ebb_owner_cat_name(EBB_OWNER_STAGING)) == "staging");
  CHECK(std::string(ebb_owner_cat_name(EBB_OWNER_BACKWARD)) == "backward");
  CHECK(std::string(ebb_owner_cat_name((ebb_owner_cat)EBB_OWNER_CAT_COUNT)) == "unknown");
  CHECK(std::string(ebb_owner_cat_name((ebb_owner_cat)99)) == "unknown");
  CHECK(std::string(ebb_alloc_action_name(EBB_ACT_FREE_COMPLETED)) == "free_completed");
  CHECK(std::string(ebb_alloc_action_name((ebb_alloc_action)99)) == "unknown");

  EBB_CHECK_FAILS(ebb_alloc_owner_pop(), EBB_ESTATE, "no owner scope open");
  EBB_CHECK_FAILS(ebb_alloc_owner_push((ebb_owner_cat)8, "x"), EBB_EINVAL, "category 8");
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_BACKWARD, "x"));  // the last category
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_CHECK_FAILS(ebb_alloc_owner_push((ebb_owner_cat)-1, "x"), EBB_EINVAL, "category -1");
  EBB_CHECK_FAILS(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, nullptr), EBB_EINVAL, "name is NULL");
  std::string longname(EBB_OWNER_NAME_MAX + 1, 'n');
  EBB_CHECK_FAILS(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, longname.c_str()), EBB_EINVAL, "longer than 127 bytes");
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, longname.substr(1).c_str()));  // exactly the limit
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  // Scopes work without ebb_init (the stack is the thread's own).
  for (int i = 0; i < EBB_OWNER_MAX_DEPTH; i++) EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "deep"));
  EBB_CHECK_FAILS(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "one too many"), EBB_ELIMIT, "32 owner scopes");
  for (int i = 0; i < EBB_OWNER_MAX_DEPTH; i++) EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_CHECK_FAILS(ebb_alloc_owner_pop(), EBB_ESTATE, "no owner scope open");

  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *p[4] = {};
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &p[0]));  // no scope: other/""
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, "w1"));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &p[1]));
  {
    std::string tmp = "grad/";  // a caller buffer reused after the push: names are copied
    tmp += "w1";
    EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_GRADIENT, tmp.c_str()));
    tmp.assign("clobbered");
  }
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &p[2]));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, "w1"));  // same text, same interned name
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &p[3]));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  std::vector<ebb_alloc_trace_entry> allocs;
  for (const auto &e : history(0))
    if (e.action == EBB_ACT_ALLOC) allocs.push_back(e);
  REQUIRE(allocs.size() == 4);
  CHECK(allocs[0].owner_cat == EBB_OWNER_OTHER);
  CHECK(std::string(allocs[0].owner_name) == "");
  CHECK(allocs[1].owner_cat == EBB_OWNER_PARAMETER);
  CHECK(std::string(allocs[1].owner_name) == "w1");
  CHECK(allocs[2].owner_cat == EBB_OWNER_GRADIENT);
  CHECK(std::string(allocs[2].owner_name) == "grad/w1");
  CHECK(allocs[3].owner_cat == EBB_OWNER_PARAMETER);
  CHECK(allocs[3].owner_name == allocs[1].owner_name);  // interned: one pointer per text
  // Other threads have their own stacks: a scope here does not leak into them.
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_OPTIMIZER, "adam"));
  void *q = nullptr;
  std::thread th([&] { EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, nullptr, &q)); });
  th.join();
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  CHECK(history(0).back().owner_cat == EBB_OWNER_OTHER);
  {
    // A pop makes the outer scope current again (the innermost scope is mirrored for the
    // allocation path), and a refused push leaves the innermost as it was.
    EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, "w1"));
    EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_GRADIENT, "g"));
    EBB_REQUIRE_OK(ebb_alloc_owner_pop());
    void *outer = nullptr, *after_fail = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &outer));
    ebb_alloc_trace_entry last = history(0).back();
    CHECK(last.owner_cat == EBB_OWNER_PARAMETER);
    CHECK(std::string(last.owner_name) == "w1");
    EBB_CHECK_FAILS(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, nullptr), EBB_EINVAL, "name is NULL");
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &after_fail));
    last = history(0).back();
    CHECK(last.owner_cat == EBB_OWNER_PARAMETER);
    CHECK(std::string(last.owner_name) == "w1");
    EBB_REQUIRE_OK(ebb_alloc_owner_pop());
    EBB_REQUIRE_OK(ebb_arena_free(outer));
    EBB_REQUIRE_OK(ebb_arena_free(after_fail));
    // The frees completed at once: each FREE_COMPLETED repeats its FREE_REQUESTED whole.
    auto h = history(0);
    REQUIRE(h.size() >= 4);
    for (size_t k : {h.size() - 3, h.size() - 1}) {
      CHECK(h[k].action == EBB_ACT_FREE_COMPLETED);
      CHECK(h[k - 1].action == EBB_ACT_FREE_REQUESTED);
      CHECK(h[k].addr == h[k - 1].addr);
      CHECK(h[k].size == h[k - 1].size);
      CHECK(h[k].requested == h[k - 1].requested);
      CHECK(h[k].stream == h[k - 1].stream);
      CHECK(h[k].time_ns == h[k - 1].time_ns);
      CHECK(h[k].owner_cat == EBB_OWNER_PARAMETER);
      CHECK(h[k].owner_name == h[k - 1].owner_name);
    }
  }
  for (void *x : p) EBB_REQUIRE_OK(ebb_arena_free(x));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("history times are the monotonic clock's and never go back, over many actions", "[alloc][history]") {
  // The ring's times come from a counter interpolated between clock reads (arena_impl.h,
  // struct ebb__hclock): check the scale and the order, with a tolerance (1 s) far above any
  // interpolation error, so that load cannot make this fail; no duration is asserted.
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  uint64_t before = ebb_trace_now_ns();
  std::vector<void *> live;
  for (int round = 0; round < 20; round++) {
    for (int i = 0; i < 200; i++) {
      void *p = nullptr;
      EBB_REQUIRE_OK(ebb_arena_alloc(0, 512 * (1 + i % 7), s, &p));
      live.push_back(p);
    }
    for (void *p : live) EBB_REQUIRE_OK(ebb_arena_free(p));
    live.clear();
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // spans several re-reads
  }
  uint64_t after = ebb_trace_now_ns();
  auto h = history(0);
  REQUIRE(h.size() > 8000);
  const uint64_t tol = 1000000000ull;
  for (size_t i = 0; i < h.size(); i++) {
    INFO("entry " << i);
    CHECK(h[i].time_ns + tol >= before);
    CHECK(h[i].time_ns <= after + tol);
    if (i) CHECK(h[i].time_ns >= h[i - 1].time_ns);
  }
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("history records alloc, free and segment actions with their owners", "[alloc][history]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *s = default_stream(0);
  uint64_t sid = 0;
  EBB_REQUIRE_OK(ebb_stream_id(s, &sid));
  uint64_t total = 99;
  CHECK(history(0, &total).empty());  // each ebb_init starts a fresh history
  CHECK(total == 0);
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, "w1"));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &p));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  auto h = history(0, &total);
  REQUIRE(h.size() == 5);
  CHECK(total == 5);
  const ebb_alloc_action want[] = {EBB_ACT_SEGMENT_ALLOC, EBB_ACT_ALLOC, EBB_ACT_FREE_REQUESTED, EBB_ACT_FREE_COMPLETED,
                                   EBB_ACT_SEGMENT_FREE};
  for (size_t i = 0; i < h.size(); i++) {
    INFO("entry " << i << ": " << ebb_alloc_action_name(h[i].action));
    CHECK(h[i].action == want[i]);
    CHECK(h[i].device == 0);
    CHECK(h[i].stream == sid);
    if (i) CHECK(h[i].time_ns >= h[i - 1].time_ns);
  }
  CHECK(h[0].size == 2 * MiB);  // the small pool's segment, made for w1's request
  CHECK(h[0].owner_cat == EBB_OWNER_PARAMETER);
  for (int i = 1; i <= 3; i++) {
    CHECK(h[i].addr == reinterpret_cast<uintptr_t>(p));
    CHECK(h[i].size == 1024);
    CHECK(h[i].requested == 1000);
    CHECK(h[i].owner_cat == EBB_OWNER_PARAMETER);
    CHECK(std::string(h[i].owner_name) == "w1");
  }
  CHECK(h[4].addr == h[0].addr);
  CHECK(h[4].size == 2 * MiB);
  CHECK(history(1).empty());  // per device

  // A block used on another stream: the free is requested now, completed after its event.
  ebb_stream_t *s2 = pool_stream(0);
  const size_t mark = history(0).size();  // the address may repeat: look only at what follows
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "x"));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, s, &p));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, s2));
  busy(s2, 4);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  h = history(0);
  bool requested = false;
  for (const auto &e : std::vector<ebb_alloc_trace_entry>(h.begin() + mark, h.end()))
    if (e.action == EBB_ACT_FREE_REQUESTED && e.addr == reinterpret_cast<uintptr_t>(p)) requested = true;
  CHECK(requested);
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));  // waits for the event, completes the free
  h = history(0);
  size_t completed = 0;
  for (const auto &e : std::vector<ebb_alloc_trace_entry>(h.begin() + mark, h.end()))
    if (e.action == EBB_ACT_FREE_COMPLETED && e.addr == reinterpret_cast<uintptr_t>(p)) {
      completed++;
      CHECK(e.owner_cat == EBB_OWNER_ACTIVATION);
      CHECK(std::string(e.owner_name) == "x");
    }
  CHECK(completed == 1);
  CHECK(h.back().action == EBB_ACT_SEGMENT_FREE);
  ebb_stream_release(s2);
  size_t n = 0;
  EBB_CHECK_FAILS(ebb_alloc_history_get(2, nullptr, 0, &n, nullptr), EBB_EDEVICE, "device 2 is out of range");
  EBB_CHECK_FAILS(ebb_alloc_history_get(0, nullptr, 0, nullptr, nullptr), EBB_EINVAL, "count is NULL");
  EBB_CHECK_FAILS(ebb_alloc_history_get(0, nullptr, 4, &n, nullptr), EBB_EINVAL, "out is NULL with cap 4");
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("the snapshot is valid JSON in PyTorch's layout and its totals match the stats", "[alloc][history]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *s = default_stream(0);
  ebb_stream_t *s1 = default_stream(1);
  std::vector<void *> live, dead;
  struct Want {
    int dev;
    ebb_owner_cat cat;
    const char *name;
    size_t bytes;
  } plan[] = {
      {0, EBB_OWNER_PARAMETER, "layer0/\"w\"", 3 * MiB}, {0, EBB_OWNER_GRADIENT, "layer0/w", 3 * MiB},
      {0, EBB_OWNER_ACTIVATION, "x0", 700 * KiB},       {0, EBB_OWNER_SAVED, "x0", 1000},
      {1, EBB_OWNER_OPTIMIZER, "adam/m", 12 * MiB},     {1, EBB_OWNER_STAGING, "h2d", 5000},
      {0, EBB_OWNER_ACTIVATION, "tmp", 40 * MiB},       {0, EBB_OWNER_OTHER, "", 64 * KiB},
  };
  int k = 0;
  for (const Want &w : plan) {
    EBB_REQUIRE_OK(ebb_alloc_owner_push(w.cat, w.name));
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(w.dev, w.bytes, w.dev ? s1 : s, &p));
    EBB_REQUIRE_OK(ebb_alloc_owner_pop());
    (k++ % 3 == 2 ? dead : live).push_back(p);
  }
  for (void *p : dead) EBB_REQUIRE_OK(ebb_arena_free(p));
  // One block waiting for another stream's work: active_pending_free while the kernels run.
  ebb_stream_t *s2 = pool_stream(0);
  void *pend = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * KiB, s, &pend));
  EBB_REQUIRE_OK(ebb_arena_record_stream(pend, s2));
  EBB_REQUIRE_OK(ebb_arena_free(pend));

  std::string path = tmp_path("ebb-snapshot");
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  // The history as the snapshot saw it: the stats calls below retire the pending free once
  // s2's work is done, which adds its free_completed.
  std::vector<ebb_alloc_trace_entry> hist0 = history(0);
  Json snap = parse_file(path);
  std::remove(path.c_str());
  REQUIRE(snap.kind == Json::Obj);
  REQUIRE(snap["segments"].kind == Json::Arr);
  REQUIRE(snap["device_traces"].kind == Json::Arr);
  REQUIRE(snap["device_traces"].arr.size() == 2);  // one list per device
  REQUIRE(snap["allocator_settings"].kind == Json::Obj);
  CHECK(snap["allocator_settings"]["history"].u == 65536);
  CHECK(snap["allocator_settings"]["expandable_segments"].kind == Json::Bool);
  CHECK(snap["allocator_settings"]["slab_max_bytes"].u == 64 * KiB);
  for (int dev = 0; dev < 2; dev++) {
    INFO("device " << dev);
    ebb_arena_stats st = stats(dev);
    SnapTotals t = totals(snap, dev);
    CHECK(t.reserved == st.reserved_bytes.current);
    CHECK(t.allocated == st.allocated_bytes.current);
    CHECK(t.requested == st.requested_bytes.current);
    CHECK(t.segments == st.segments.current);
    // Work on s2 may finish before the snapshot; active is between allocated and stats' active.
    CHECK(t.active >= t.allocated);
    CHECK(t.active <= st.allocated_bytes.current + 8 * KiB);
  }
  // Every segment and block carries PyTorch's keys, and blocks the owner that allocated them.
  std::map<uint64_t, std::pair<std::string, std::string>> owners;
  for (const Json &g : snap["segments"].arr) {
    for (const char *key : {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                            "segment_type", "is_expandable", "blocks", "frames"})
      CHECK(g.has(key));
    CHECK((g["segment_type"].s == "small" || g["segment_type"].s == "large"));
    for (const Json &b : g["blocks"].arr) {
      for (const char *key : {"address", "size", "requested_size", "state", "owner"}) CHECK(b.has(key));
      if (b["state"].s == "active_allocated") owners[b["address"].u] = {b["owner"]["category"].s, b["owner"]["name"].s};
    }
  }
  REQUIRE(owners.size() == live.size());
  CHECK(owners[reinterpret_cast<uintptr_t>(live[0])] == std::make_pair(std::string("parameter"), std::string("layer0/\"w\"")));
  CHECK(owners[reinterpret_cast<uintptr_t>(live[1])] == std::make_pair(std::string("gradient"), std::string("layer0/w")));
  CHECK(owners[reinterpret_cast<uintptr_t>(live[2])] == std::make_pair(std::string("saved"), std::string("x0")));
  CHECK(owners[reinterpret_cast<uintptr_t>(live[3])] == std::make_pair(std::string("optimizer"), std::string("adam/m")));
  // The traces: device 0 holds its own actions, oldest first, with PyTorch's keys and names.
  const Json &tr0 = snap["device_traces"].arr[0];
  REQUIRE(tr0.arr.size() == hist0.size());
  uint64_t last = 0;
  std::map<std::string, int> actions;
  for (const Json &e : tr0.arr) {
    for (const char *key : {"action", "addr", "size", "requested_size", "stream", "time_us", "device", "owner"})
      CHECK(e.has(key));
    CHECK(e["device"].u == 0);
    CHECK(e["time_us"].u >= last);
    last = e["time_us"].u;
    actions[e["action"].s]++;
  }
  CHECK(actions["segment_alloc"] >= 3);
  CHECK(actions["alloc"] == 7);
  CHECK(actions["free_requested"] == 2);
  CHECK(snap["device_traces"].arr[1].arr.size() == history(1).size());
  EBB_CHECK_FAILS(ebb_memory_snapshot_json(nullptr), EBB_EINVAL, "path is NULL");
  EBB_CHECK_FAILS(ebb_memory_snapshot_json("/nonexistent-dir/x.json"), EBB_EIO, "/nonexistent-dir/x.json");
  for (void *p : live) EBB_REQUIRE_OK(ebb_arena_free(p));
  ebb_stream_release(s2);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A new slab's block is carved with the arena lock dropped before its slab record exists. The
// walks over every block (the OOM report's top owners, the snapshot, the debug walk) run on
// another thread meanwhile and must see it as a slab in the making, not follow a missing record.
TEST_CASE("the OOM report, the snapshot and the debug walk meet slabs being made on another thread",
          "[alloc][history][threads]") {
  EbbSession session;
  std::atomic<int> done{0}, enough{0}, maker_bad{0}; // (Catch2's assertions are for the main thread)
  std::thread maker([&] {
    ebb_stream_t *s = nullptr;
    if (ebb_stream_create(0, EBB_PRIO_LOW, &s) != EBB_OK) maker_bad++;
    for (int i = 0; s && (i < 20000 || !enough.load()) && i < 2000000; i++) {
      void *p = nullptr;
      size_t n = static_cast<size_t>(1 + i % 128) * 512; // every size class in turn: mostly new slabs
      if (ebb_arena_alloc(0, n, s, &p) != EBB_OK || ebb_arena_free(p) != EBB_OK) maker_bad++;
      if (i % 128 == 127 && ebb_arena_empty_cache(0) != EBB_OK) maker_bad++;
    }
    if (s && (ebb_stream_synchronize(s) != EBB_OK || ebb_stream_release(s) != EBB_OK)) maker_bad++;
    done = 1;
  });
  std::string path = tmp_path("slab-race");
  int bad = 0, rounds = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::string first_bad;
  while (!done.load()) {
    void *p = nullptr;
    ebb_status st = EBB_OK;
    switch (rounds++ % 3) {
    case 0: st = ebb_arena_alloc(0, size_t(1) << 51, nullptr, &p) == EBB_ENOMEM ? EBB_OK : EBB_EINTERNAL; break;
    case 1: st = ebb_memory_snapshot_json(path.c_str()); break;
    default: st = ebb_arena_debug_check(0); break;
    }
    if (st && !bad++) first_bad = ebb_last_error();
    // 500 of each walk, or what 3 s allow (sanitizer builds walk many times slower).
    if (rounds == 1500 || std::chrono::steady_clock::now() - t0 > std::chrono::seconds(3)) enough = 1;
  }
  maker.join();
  INFO(rounds << " rounds; first failure: " << first_bad);
  CHECK(bad == 0);
  CHECK(maker_bad == 0);
  std::remove(path.c_str());
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A layer that takes over memory another one allocated (autograd: a saved activation, a gradient
// a backward produced) re-tags the block; the query reads what snapshots and OOM reports show.
TEST_CASE("a live block's owner can be read and re-tagged in every pool, and snapshots and frees show the new one",
          "[alloc][history][owner]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *big = nullptr, *slot = nullptr, *host = nullptr, *pinned = nullptr;
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "x"));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &big));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &slot));  // a slab slot
  EBB_REQUIRE_OK(ebb_pageable_alloc(4096, &host));
  EBB_REQUIRE_OK(ebb_pinned_alloc(4096, -1, &pinned));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  for (void *p : {big, slot, host, pinned}) {
    ebb_owner_cat cat = EBB_OWNER_OTHER;
    const char *name = nullptr;
    EBB_REQUIRE_OK(ebb_alloc_block_owner(p, &cat, &name));
    CHECK(cat == EBB_OWNER_ACTIVATION);
    CHECK(std::string(name) == "x");
    ebb_owner_cat oc = EBB_OWNER_OTHER;
    const char *on = nullptr;
    EBB_REQUIRE_OK(ebb_alloc_block_set_owner(p, EBB_OWNER_SAVED, "MulBackward", &oc, &on));
    CHECK(oc == EBB_OWNER_ACTIVATION);
    CHECK(on == name);  // interned: the same pointer, fit to restore with
    EBB_REQUIRE_OK(ebb_alloc_block_owner(p, &cat, &name));
    CHECK(cat == EBB_OWNER_SAVED);
    CHECK(std::string(name) == "MulBackward");
  }
  std::string path = tmp_path("ebb-retag");
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  Json snap = parse_file(path);
  std::remove(path.c_str());
  int seen = 0;
  for (const Json &g : snap["segments"].arr)
    for (const Json &b : g["blocks"].arr)
      if (b["address"].u == (unsigned long long)(uintptr_t)big || b["address"].u == (unsigned long long)(uintptr_t)slot) {
        CHECK(b["owner"]["category"].s == "saved");
        CHECK(b["owner"]["name"].s == "MulBackward");
        seen++;
      }
  CHECK(seen == 2);
  // Restored with the old name; the free's history entry carries the owner of the moment.
  EBB_REQUIRE_OK(ebb_alloc_block_set_owner(big, EBB_OWNER_ACTIVATION, "x", nullptr, nullptr));
  EBB_REQUIRE_OK(ebb_alloc_block_set_owner(slot, EBB_OWNER_GRADIENT, "w", nullptr, nullptr));
  EBB_REQUIRE_OK(ebb_arena_free(slot));
  size_t n = 0;
  std::vector<ebb_alloc_trace_entry> tr(64);
  EBB_REQUIRE_OK(ebb_alloc_history_get(0, tr.data(), tr.size(), &n, nullptr));
  REQUIRE(n > 0);
  CHECK(tr[n - 1].owner_cat == EBB_OWNER_GRADIENT);
  CHECK(std::string(tr[n - 1].owner_name) == "w");
  // Bad input: NULL, a freed block, an interior pointer, memory of no pool, a bad category.
  ebb_owner_cat cat;
  EBB_CHECK_FAILS(ebb_alloc_block_owner(nullptr, &cat, nullptr), EBB_EINVAL, "ptr is NULL");
  EBB_CHECK_FAILS(ebb_alloc_block_owner(big, nullptr, nullptr), EBB_EINVAL, "cat is NULL");
  EBB_CHECK_FAILS(ebb_alloc_block_owner(slot, &cat, nullptr), EBB_EINVAL, "a freed block");
  EBB_CHECK_FAILS(ebb_alloc_block_owner((char *)big + 512, &cat, nullptr), EBB_EINVAL, "is inside the block");
  int local = 0;
  EBB_CHECK_FAILS(ebb_alloc_block_owner(&local, &cat, nullptr), EBB_EINVAL, "not a block of any ebb pool");
  EBB_CHECK_FAILS(ebb_alloc_block_set_owner(big, (ebb_owner_cat)EBB_OWNER_CAT_COUNT, "x", nullptr, nullptr), EBB_EINVAL,
                  "is not an ebb_owner_cat");
  EBB_CHECK_FAILS(ebb_alloc_block_set_owner(big, EBB_OWNER_SAVED, nullptr, nullptr, nullptr), EBB_EINVAL, "name is NULL");
  EBB_REQUIRE_OK(ebb_alloc_block_owner(big, &cat, nullptr));
  CHECK(cat == EBB_OWNER_ACTIVATION);  // a refused set changes nothing
  EBB_REQUIRE_OK(ebb_arena_free(big));
  EBB_REQUIRE_OK(ebb_pageable_free(host));
  EBB_REQUIRE_OK(ebb_pinned_free(pinned));
}

TEST_CASE("snapshot and history calls need ebb_init", "[alloc][history]") {
  size_t n = 0;
  ebb_owner_cat cat;
  EBB_CHECK_FAILS(ebb_alloc_block_owner(&n, &cat, nullptr), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_memory_snapshot_json("/tmp/never.json"), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_alloc_history_get(0, nullptr, 0, &n, nullptr), EBB_ENOTINIT, "ebb_init");
}

TEST_CASE("owner names that are not UTF-8 make a snapshot every JSON reader accepts", "[alloc][history]") {
  EbbSession session;
  // Latin-1 (0xE9: é there, a stray lead byte in UTF-8), well-formed UTF-8 (ï), a sequence
  // cut short, a surrogate and an overlong form, a quote and a control.
  const std::vector<std::string> names = {"caf\xe9", "na\xc3\xafve", "cut\xe2\x82", "\xed\xa0\x80\xc0\xaf", "q\"\x01"};
  // What a reader gets back: UTF-8 kept, any other byte as the code point of its value; the
  // test's reader turns \u00XX back into that byte, so it sees the bytes given.
  std::vector<void *> blocks;
  for (const std::string &n : names) {
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, nullptr, &p));
    EBB_REQUIRE_OK(ebb_alloc_block_set_owner(p, EBB_OWNER_ACTIVATION, n.c_str(), nullptr, nullptr));
    blocks.push_back(p);
  }
  // The first two are freed: the free's history entries carry the names too.
  EBB_REQUIRE_OK(ebb_arena_free(blocks[0]));
  EBB_REQUIRE_OK(ebb_arena_free(blocks[1]));
  std::string path = tmp_path("ebb-snapshot-utf8");
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  std::string text = slurp(path);
  CHECK(ebb_first_bad_utf8(text) == std::string::npos);
  Json snap = parse_file(path);  // and Python's json, where it is installed
  std::remove(path.c_str());
  std::map<std::string, int> in_blocks, in_trace;
  for (const Json &g : snap["segments"].arr)
    for (const Json &b : g["blocks"].arr)
      if (b["state"].s == "active_allocated") in_blocks[b["owner"]["name"].s]++;
  for (const Json &e : snap["device_traces"].arr[0].arr) in_trace[e["owner"]["name"].s]++;
  for (size_t k = 2; k < names.size(); k++) CHECK(in_blocks[names[k]] == 1);
  CHECK(in_trace[names[0]] == 2);  // free_requested, free_completed
  CHECK(in_trace[names[1]] == 2);
  for (size_t k = 2; k < names.size(); k++) EBB_REQUIRE_OK(ebb_arena_free(blocks[k]));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

#elif EBB_HIST_MODE == EBB_HIST_WRAP

TEST_CASE("the ring keeps the newest N actions, oldest first", "[alloc][history]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  // Action k: 0 is the segment, then per round i: alloc, free_requested, free_completed.
  const int rounds = 100;
  for (int i = 0; i < rounds; i++) {
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000 + i, s, &p));
    EBB_REQUIRE_OK(ebb_arena_free(p));
  }
  uint64_t total = 0;
  auto h = history(0, &total);
  REQUIRE(total == 1 + 3 * rounds);
  REQUIRE(h.size() == 64);
  for (size_t j = 0; j < h.size(); j++) {
    uint64_t k = total - h.size() + j;  // this entry's position in the whole sequence
    int round = (int)((k - 1) / 3), step = (int)((k - 1) % 3);
    INFO("entry " << j << " (action " << k << ")");
    CHECK(h[j].action == (step == 0 ? EBB_ACT_ALLOC : step == 1 ? EBB_ACT_FREE_REQUESTED : EBB_ACT_FREE_COMPLETED));
    CHECK(h[j].requested == (uint64_t)(1000 + round));
    // A completion repeats its request entry, also across the ring's wrap (slot 0 copies slot
    // 63: action 192 is a completion written at slot 0).
    if (step == 2 && j > 0) {
      CHECK(h[j].addr == h[j - 1].addr);
      CHECK(h[j].size == h[j - 1].size);
      CHECK(h[j].time_ns == h[j - 1].time_ns);
      CHECK(h[j].stream == h[j - 1].stream);
    }
  }
  // A smaller copy gets the newest ones.
  ebb_alloc_trace_entry few[5];
  size_t n = 0;
  EBB_REQUIRE_OK(ebb_alloc_history_get(0, few, 5, &n, nullptr));
  REQUIRE(n == 5);
  for (int j = 0; j < 5; j++) CHECK(few[j].time_ns == h[59 + j].time_ns);
  CHECK(few[4].action == EBB_ACT_FREE_COMPLETED);
  CHECK(few[4].requested == 1000 + rounds - 1);
  std::string path = tmp_path("ebb-snapshot-wrap");
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  Json snap = parse_file(path);
  std::remove(path.c_str());
  CHECK(snap["device_traces"].arr[0].arr.size() == 64);
  CHECK(snap["allocator_settings"]["history"].u == 64);
  CHECK(snap["allocator_settings"]["EBB_ALLOC_CONF"].s == "history:64");
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("a free completed at once reads back as two actions, at every cut of the wrapped ring", "[alloc][history]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  ebb_stream_t *s2 = pool_stream(0);
  // Frees that complete at once (their two actions share a ring slot) mixed with frees another
  // stream's use defers (request and completion recorded apart), past the ring's wrap.
  const int rounds = 90;
  for (int i = 0; i < rounds; i++) {
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000 + i, s, &p));
    if (i % 3 == 0) EBB_REQUIRE_OK(ebb_arena_record_stream(p, s2));
    EBB_REQUIRE_OK(ebb_arena_free(p));
  }
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));  // the deferred frees complete
  uint64_t total = 0;
  auto h = history(0, &total);
  REQUIRE(total > 2 * 64);  // more than two actions per slot: the ring's slots have wrapped
  REQUIRE(h.size() == 64);
  int pairs = 0;
  for (size_t j = 0; j < h.size(); j++) {
    INFO("entry " << j << ": " << ebb_alloc_action_name(h[j].action));
    CHECK(std::string(ebb_alloc_action_name(h[j].action)) != "unknown");  // no ring-internal action escapes
    // Round i requested 1000 + i bytes; a round not used on s2 completed its free at once.
    if (h[j].action == EBB_ACT_FREE_REQUESTED && (h[j].requested - 1000) % 3 != 0 && j + 1 < h.size()) {
      pairs++;
      CHECK(h[j + 1].action == EBB_ACT_FREE_COMPLETED);
      CHECK(h[j + 1].time_ns == h[j].time_ns);
      CHECK(h[j + 1].addr == h[j].addr);
      CHECK(h[j + 1].size == h[j].size);
      CHECK(h[j + 1].requested == h[j].requested);
      CHECK(h[j + 1].stream == h[j].stream);
      CHECK(h[j + 1].owner_cat == h[j].owner_cat);
      CHECK(std::string(h[j + 1].owner_name) == h[j].owner_name);
    }
  }
  CHECK(pairs >= 10);
  // Every smaller copy is the newest part of the full one, whether its oldest entry is the
  // first or the second half of a shared slot.
  for (size_t n = 1; n <= h.size(); n++) {
    std::vector<ebb_alloc_trace_entry> v(n);
    size_t got = 0;
    uint64_t t2 = 0;
    EBB_REQUIRE_OK(ebb_alloc_history_get(0, v.data(), n, &got, &t2));
    REQUIRE(got == n);
    CHECK(t2 == total);
    for (size_t j = 0; j < n; j++) {
      const ebb_alloc_trace_entry &a = v[j], &b = h[h.size() - n + j];
      INFO("copy of " << n << ", entry " << j);
      CHECK(a.action == b.action);
      CHECK(a.time_ns == b.time_ns);
      CHECK(a.addr == b.addr);
      CHECK(a.size == b.size);
      CHECK(a.requested == b.requested);
      CHECK(a.stream == b.stream);
      CHECK(a.device == b.device);
      CHECK(a.owner_cat == b.owner_cat);
      CHECK(std::string(a.owner_name) == b.owner_name);
    }
  }
  // The snapshot's trace is the same 64 actions.
  std::string path = tmp_path("ebb-snapshot-pairs");
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  Json snap = parse_file(path);
  std::remove(path.c_str());
  const Json &tr = snap["device_traces"].arr[0];
  REQUIRE(tr.arr.size() == h.size());
  for (size_t j = 0; j < h.size(); j++) {
    INFO("trace entry " << j);
    CHECK(tr.arr[j]["action"].s == ebb_alloc_action_name(h[j].action));
    CHECK(tr.arr[j]["addr"].u == h[j].addr);
    CHECK(tr.arr[j]["requested_size"].u == h[j].requested);
    CHECK(tr.arr[j]["time_us"].u == h[j].time_ns / 1000);
  }
  ebb_stream_release(s2);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

#elif EBB_HIST_MODE == EBB_HIST_OFF

TEST_CASE("history:0 records nothing and the snapshot still has the segments", "[alloc][history]") {
  EbbSession session;
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, nullptr, &p));
  uint64_t total = 1;
  CHECK(history(0, &total).empty());
  CHECK(total == 0);
  std::string path = tmp_path("ebb-snapshot-off");
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  Json snap = parse_file(path);
  std::remove(path.c_str());
  CHECK(snap["segments"].arr.size() == 1);
  CHECK(snap["device_traces"].arr.size() == (size_t)ebb_test_device_count()); // one per device: 2 emulated
  CHECK(snap["device_traces"].arr[0].arr.empty());
  EBB_REQUIRE_OK(ebb_arena_free(p));
  REQUIRE(ebb_debug_live_handles() == 0);
}

#elif EBB_HIST_MODE == EBB_HIST_OOM

static const bool kEnvSet = setenv("EBB_SIM_MEM", "128M", 0) == 0;

TEST_CASE("an allocation failing with EBB_ENOMEM writes oom_snapshot and names live bytes by category and the top owners", "[alloc][history][oom]") {
  std::remove(EBB_HIST_OOM_PATH);
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *w = nullptr, *x = nullptr, *y = nullptr, *u = nullptr, *p = nullptr;
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, "w1"));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 60 * MiB, s, &w));
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "x"));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 30 * MiB, s, &x));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 10 * MiB, s, &y));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &u));
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_GRADIENT, "w1"));
  ebb_clear_error();
  ebb_status st = ebb_arena_alloc(0, 50 * MiB, s, &p);
  std::string msg = ebb_last_error();
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  INFO(msg);
  REQUIRE(st == EBB_ENOMEM);
  CHECK(msg.find("device 0 out of memory: requested 50.00 MiB") != std::string::npos);
  CHECK(msg.find("; live by owner category: parameter 60.00 MiB, activation 40.00 MiB, other 12.00 MiB; top owners: "
                 "parameter/w1 60.00 MiB, activation/x 40.00 MiB, other/(none) 12.00 MiB") != std::string::npos);

  Json snap = parse_file(EBB_HIST_OOM_PATH);
  CHECK(snap["allocator_settings"]["oom_snapshot"].s == EBB_HIST_OOM_PATH);
  const Json &tr = snap["device_traces"].arr.at(0);
  REQUIRE(!tr.arr.empty());
  const Json &oom = tr.arr.back();  // the failure is the newest action
  CHECK(oom["action"].s == "oom");
  CHECK(oom["size"].u == 50 * MiB);
  CHECK(oom.has("device_free"));
  CHECK(oom["owner"]["category"].s == "gradient");
  CHECK(oom["owner"]["name"].s == "w1");
  ebb_arena_stats stt = stats(0);
  SnapTotals t = totals(snap, 0);
  CHECK(t.allocated == stt.allocated_bytes.current);
  CHECK(t.reserved == stt.reserved_bytes.current);
  std::remove(EBB_HIST_OOM_PATH);
  for (void *q : {w, x, y, u}) EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

#endif
