// A checker of ebb's Chrome/Perfetto trace JSON (ebb_trace_export_json): a small JSON reader, and
// the rules a viewer's importer relies on: every event has a phase, a name, a pid and a
// timestamp; slices on one track (pid, tid) nest (no partial overlap); every flow start has one
// end with the same id and each lies inside a slice of its own track; every track and process is
// named by metadata. Used by the trace tests and by the trace_check program (ebb-train's trace).
// No Catch2 here: the caller checks the report.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace trace_check {

// ---- a minimal JSON value and reader ----------------------------------------------------------

struct Json {
  enum Kind { Null, Bool, Num, Str, Arr, Obj } kind = Null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<Json> arr;
  std::vector<std::pair<std::string, Json>> obj;
  const Json *get(const std::string &k) const {
    for (const auto &kv : obj)
      if (kv.first == k) return &kv.second;
    return nullptr;
  }
};

class Reader {
 public:
  explicit Reader(const std::string &s) : s_(s) {}
  // The whole text as one value; false (with err()) on any syntax error or trailing text.
  bool parse(Json *out) {
    if (!value(out, 0)) return false;
    ws();
    if (p_ != s_.size()) return fail("trailing text");
    return true;
  }
  const std::string &err() const { return err_; }

 private:
  const std::string &s_;
  size_t p_ = 0;
  std::string err_;
  bool fail(const char *what) {
    if (err_.empty()) err_ = std::string(what) + " at offset " + std::to_string(p_);
    return false;
  }
  void ws() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\n' || s_[p_] == '\r' || s_[p_] == '\t')) p_++;
  }
  bool lit(const char *w) {
    size_t n = std::char_traits<char>::length(w);
    if (s_.compare(p_, n, w) != 0) return fail("bad literal");
    p_ += n;
    return true;
  }
  bool string(std::string *out) {
    if (p_ >= s_.size() || s_[p_] != '"') return fail("expected a string");
    p_++;
    while (p_ < s_.size() && s_[p_] != '"') {
      char c = s_[p_++];
      if ((unsigned char)c < 0x20) return fail("control character in a string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (p_ >= s_.size()) return fail("truncated escape");
      char e = s_[p_++];
      switch (e) {
      case '"': case '\\': case '/': out->push_back(e); break;
      case 'n': out->push_back('\n'); break;
      case 't': out->push_back('\t'); break;
      case 'r': out->push_back('\r'); break;
      case 'b': out->push_back('\b'); break;
      case 'f': out->push_back('\f'); break;
      case 'u': {
        if (p_ + 4 > s_.size()) return fail("truncated \\u escape");
        unsigned v = (unsigned)std::strtoul(s_.substr(p_, 4).c_str(), nullptr, 16);
        p_ += 4;
        // The code point as UTF-8 (ebb escapes controls, and bytes that are not UTF-8 as
        // \u0080..\u00ff; surrogate pairs are never written).
        if (v < 0x80) {
          out->push_back((char)v);
        } else if (v < 0x800) {
          out->push_back((char)(0xC0 | v >> 6));
          out->push_back((char)(0x80 | (v & 0x3F)));
        } else {
          out->push_back((char)(0xE0 | v >> 12));
          out->push_back((char)(0x80 | (v >> 6 & 0x3F)));
          out->push_back((char)(0x80 | (v & 0x3F)));
        }
        break;
      }
      default: return fail("bad escape");
      }
    }
    if (p_ >= s_.size()) return fail("unterminated string");
    p_++;
    return true;
  }
  bool number(double *out) {
    size_t b = p_;
    if (p_ < s_.size() && s_[p_] == '-') p_++;
    if (p_ >= s_.size() || !isdigit((unsigned char)s_[p_])) return fail("bad number");
    while (p_ < s_.size() && (isdigit((unsigned char)s_[p_]) || s_[p_] == '.' || s_[p_] == 'e' || s_[p_] == 'E' || s_[p_] == '+' ||
                              s_[p_] == '-'))
      p_++;
    char *end = nullptr;
    std::string t = s_.substr(b, p_ - b);
    *out = std::strtod(t.c_str(), &end);
    if (*end) return fail("bad number");
    return true;
  }
  bool value(Json *v, int depth) {
    if (depth > 64) return fail("nested too deep");
    ws();
    if (p_ >= s_.size()) return fail("unexpected end");
    char c = s_[p_];
    if (c == '{') {
      v->kind = Json::Obj;
      p_++;
      ws();
      if (p_ < s_.size() && s_[p_] == '}') return p_++, true;
      for (;;) {
        ws();
        std::string k;
        if (!string(&k)) return false;
        ws();
        if (p_ >= s_.size() || s_[p_] != ':') return fail("expected ':'");
        p_++;
        v->obj.emplace_back(k, Json());
        if (!value(&v->obj.back().second, depth + 1)) return false;
        ws();
        if (p_ < s_.size() && s_[p_] == ',') {
          p_++;
          continue;
        }
        if (p_ < s_.size() && s_[p_] == '}') return p_++, true;
        return fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v->kind = Json::Arr;
      p_++;
      ws();
      if (p_ < s_.size() && s_[p_] == ']') return p_++, true;
      for (;;) {
        v->arr.emplace_back();
        if (!value(&v->arr.back(), depth + 1)) return false;
        ws();
        if (p_ < s_.size() && s_[p_] == ',') {
          p_++;
          continue;
        }
        if (p_ < s_.size() && s_[p_] == ']') return p_++, true;
        return fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v->kind = Json::Str;
      return string(&v->str);
    }
    if (c == 't') return v->kind = Json::Bool, v->b = true, lit("true");
    if (c == 'f') return v->kind = Json::Bool, v->b = false, lit("false");
    if (c == 'n') return v->kind = Json::Null, lit("null");
    v->kind = Json::Num;
    return number(&v->num);
  }
};

// ---- the trace's rules --------------------------------------------------------------------------

struct Slice {
  std::string name;
  int64_t pid, tid;
  double ts, dur;
  Json args; // (a copy: the document is gone when check returns)
};

struct Report {
  std::vector<std::string> errors; // empty: the trace is valid
  std::map<std::string, size_t> by_phase;         // "X", "i", "C", "s", "f", "M"
  std::map<std::string, size_t> slices_by_name;   // "X" events
  std::vector<Slice> slices;
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names;
  std::map<int64_t, std::string> process_names;
  std::set<std::string> counters;                 // counter names
  size_t flows_paired = 0;
  std::string display_unit;
  void error(const std::string &e) {
    if (errors.size() < 20) errors.push_back(e);
  }
};

inline bool num_of(const Json &e, const char *k, double *out) {
  const Json *v = e.get(k);
  if (!v || v->kind != Json::Num) return false;
  *out = v->num;
  return true;
}

// Checks the text of one trace; everything found goes to *r.
inline void check(const std::string &text, Report *r) {
  Json root;
  Reader rd(text);
  if (!rd.parse(&root)) return r->error("not JSON: " + rd.err());
  if (root.kind != Json::Obj) return r->error("the top level is not an object");
  if (const Json *u = root.get("displayTimeUnit")) r->display_unit = u->str;
  const Json *evs = root.get("traceEvents");
  if (!evs || evs->kind != Json::Arr) return r->error("no traceEvents array");
  struct Flow {
    int64_t pid, tid;
    double ts;
    int n;
  };
  std::map<std::string, Flow> starts, ends; // by "cat/id"
  std::set<std::pair<int64_t, int64_t>> tracks;
  std::set<int64_t> pids;
  for (size_t i = 0; i < evs->arr.size(); i++) {
    const Json &e = evs->arr[i];
    std::string at = "event " + std::to_string(i);
    if (e.kind != Json::Obj) {
      r->error(at + " is not an object");
      continue;
    }
    const Json *ph = e.get("ph"), *name = e.get("name");
    double pid = 0, tid = 0, ts = 0, dur = 0;
    if (!ph || ph->kind != Json::Str || !name || name->kind != Json::Str || !num_of(e, "pid", &pid)) {
      r->error(at + ": no ph, name or pid");
      continue;
    }
    if (pid < 0) r->error(at + ": negative pid");
    r->by_phase[ph->str]++;
    pids.insert((int64_t)pid);
    const Json *args = e.get("args");
    if (ph->str == "M") {
      const Json *nm = args ? args->get("name") : nullptr;
      if (!nm || nm->kind != Json::Str || nm->str.empty()) r->error(at + ": metadata without args.name");
      else if (name->str == "process_name") r->process_names[(int64_t)pid] = nm->str;
      else if (name->str == "thread_name" && num_of(e, "tid", &tid)) r->thread_names[{(int64_t)pid, (int64_t)tid}] = nm->str;
      continue;
    }
    if (!num_of(e, "ts", &ts) || ts < 0) {
      r->error(at + ": no ts");
      continue;
    }
    if (ph->str == "C") {
      if (!args || args->kind != Json::Obj || args->obj.empty()) r->error(at + ": counter without values");
      r->counters.insert(name->str);
      continue;
    }
    if (!num_of(e, "tid", &tid)) {
      r->error(at + ": no tid");
      continue;
    }
    tracks.insert({(int64_t)pid, (int64_t)tid});
    if (ph->str == "X") {
      if (!num_of(e, "dur", &dur) || dur < 0) {
        r->error(at + ": slice without dur");
        continue;
      }
      r->slices.push_back({name->str, (int64_t)pid, (int64_t)tid, ts, dur, args ? *args : Json()});
      r->slices_by_name[name->str]++;
    } else if (ph->str == "s" || ph->str == "f") {
      const Json *id = e.get("id"), *cat = e.get("cat");
      if (!id || !cat) {
        r->error(at + ": flow without id or cat");
        continue;
      }
      std::string key = cat->str + "/" + std::to_string((long long)id->num);
      auto &m = ph->str == "s" ? starts : ends;
      Flow &f = m[key];
      f = {(int64_t)pid, (int64_t)tid, ts, f.n + 1};
    } else if (ph->str != "i") {
      r->error(at + ": unknown phase " + ph->str);
    }
  }
  // Nesting: per track, by start then longer first; a slice starting inside an open one ends
  // inside it too.
  std::vector<const Slice *> sl;
  for (const auto &s : r->slices) sl.push_back(&s);
  std::sort(sl.begin(), sl.end(), [](const Slice *a, const Slice *b) {
    return std::make_tuple(a->pid, a->tid, a->ts, -a->dur) < std::make_tuple(b->pid, b->tid, b->ts, -b->dur);
  });
  std::vector<const Slice *> open;
  const double eps = 1e-6; // the export's 1 ns digits, read back as doubles
  for (size_t i = 0; i < sl.size(); i++) {
    const Slice *s = sl[i];
    if (i && (s->pid != sl[i - 1]->pid || s->tid != sl[i - 1]->tid)) open.clear();
    while (!open.empty() && open.back()->ts + open.back()->dur <= s->ts + eps) open.pop_back();
    if (!open.empty() && s->ts + s->dur > open.back()->ts + open.back()->dur + eps)
      r->error("slice '" + s->name + "' overlaps '" + open.back()->name + "' on track (" + std::to_string(s->pid) + ", " +
               std::to_string(s->tid) + ") without nesting");
    open.push_back(s);
  }
  // Flows: paired, each end inside a slice of its own track.
  auto inside = [&](int64_t pid, int64_t tid, double ts) {
    for (const auto &s : r->slices)
      if (s.pid == pid && s.tid == tid && s.ts <= ts + eps && ts <= s.ts + s.dur + eps) return true;
    return false;
  };
  for (const auto &kv : starts) {
    auto e = ends.find(kv.first);
    if (kv.second.n != 1) r->error("flow " + kv.first + " starts " + std::to_string(kv.second.n) + " times");
    if (e == ends.end()) {
      r->error("flow " + kv.first + " starts and never ends");
      continue;
    }
    if (e->second.n != 1) r->error("flow " + kv.first + " ends " + std::to_string(e->second.n) + " times");
    if (e->second.ts < kv.second.ts) r->error("flow " + kv.first + " ends before it starts");
    if (!inside(kv.second.pid, kv.second.tid, kv.second.ts)) r->error("flow " + kv.first + " starts outside any slice of its track");
    if (!inside(e->second.pid, e->second.tid, e->second.ts)) r->error("flow " + kv.first + " ends outside any slice of its track");
    r->flows_paired++;
  }
  for (const auto &kv : ends)
    if (!starts.count(kv.first)) r->error("flow " + kv.first + " ends without a start");
  for (const auto &t : tracks)
    if (!r->thread_names.count(t))
      r->error("track (" + std::to_string(t.first) + ", " + std::to_string(t.second) + ") has no thread_name");
  for (int64_t p : pids)
    if (!r->process_names.count(p)) r->error("process " + std::to_string(p) + " has no process_name");
}

} // namespace trace_check
