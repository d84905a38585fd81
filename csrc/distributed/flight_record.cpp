#include "distributed/flight_record.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

namespace cx::distributed {

namespace {

constexpr uint32_t kRecordMagic = 0x32525843;  // "CXR2"

// One step of the fingerprint: a 64-bit mix (splitmix64's finalizer) of the
// running value and one word of the descriptor.
uint64_t mix(uint64_t h, uint64_t v) {
  uint64_t z = h + v + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct Writer {
  std::string out;
  template <typename T>
  void put(T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
};

struct Reader {
  const std::string& in;
  size_t at = 0;
  bool ok = true;
  template <typename T>
  T get() {
    T v{};
    if (at + sizeof(T) > in.size()) {
      ok = false;
      return v;
    }
    std::memcpy(&v, in.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
};

const char* state_name(FlightEntry::State s) {
  switch (s) {
    case FlightEntry::kQueued: return "queued";
    case FlightEntry::kRunning: return "running";
    case FlightEntry::kDone: return "done";
    case FlightEntry::kFailed: return "failed";
  }
  return "?";
}

std::string describe_entry(const FlightEntry& e, int64_t now) {
  std::ostringstream os;
  os << e.desc.describe() << " " << state_name(e.state);
  if (e.state == FlightEntry::kDone || e.state == FlightEntry::kFailed) {
    os << " after " << (e.end_us - e.start_us) / 1000.0 << " ms";
  } else if (e.state == FlightEntry::kRunning) {
    os << " for " << (now - e.start_us) / 1000 << " ms";
  }
  return os.str();
}

}  // namespace

uint64_t fold(uint64_t h, const OpDesc& d) {
  h = mix(h, static_cast<uint64_t>(d.kind) | static_cast<uint64_t>(d.dtype) << 8 |
                 static_cast<uint64_t>(d.op) << 16 | static_cast<uint64_t>(static_cast<uint32_t>(d.root)) << 32);
  h = mix(h, d.count);
  h = mix(h, d.seq);
  return d.site ? mix(h, d.site) : h;  // Note [Call sites in CX_DEBUG=DETAIL]
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string join_ranks(const std::vector<int>& v) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str();
}

std::string FlightRecord::encode() const {
  Writer w;
  w.put<uint32_t>(kRecordMagic);
  w.put<int32_t>(rank);
  w.put<uint8_t>(failed ? 1 : 0);
  w.put<uint64_t>(fingerprint);
  w.put<uint64_t>(collectives);
  w.put<uint32_t>(static_cast<uint32_t>(sent.size()));
  for (size_t i = 0; i < sent.size(); ++i) {
    w.put<uint64_t>(sent[i]);
    w.put<uint64_t>(recvd[i]);
  }
  w.put<uint32_t>(static_cast<uint32_t>(entries.size()));
  for (const auto& e : entries) {
    w.put<uint64_t>(e.op);
    w.put<uint8_t>(static_cast<uint8_t>(e.desc.kind));
    w.put<uint8_t>(static_cast<uint8_t>(e.desc.dtype));
    w.put<uint8_t>(static_cast<uint8_t>(e.desc.op));
    w.put<uint8_t>(static_cast<uint8_t>(e.state));
    w.put<int32_t>(e.desc.root);
    w.put<uint64_t>(e.desc.count);
    w.put<uint64_t>(e.desc.seq);
    w.put<uint64_t>(e.fingerprint);
    w.put<int64_t>(e.submit_us);
    w.put<int64_t>(e.start_us);
    w.put<int64_t>(e.end_us);
    const std::string site = e.desc.site ? call_site_text(e.desc.site).substr(0, 256) : "";
    w.put<uint32_t>(e.desc.site);
    w.put<uint16_t>(static_cast<uint16_t>(site.size()));
    w.out += site;
  }
  const std::string err = error.substr(0, 4096);
  w.put<uint32_t>(static_cast<uint32_t>(err.size()));
  w.out += err;
  return w.out;
}

std::optional<FlightRecord> FlightRecord::decode(const std::string& bytes) {
  Reader r{bytes};
  FlightRecord f;
  if (r.get<uint32_t>() != kRecordMagic) return std::nullopt;
  f.rank = r.get<int32_t>();
  f.failed = r.get<uint8_t>() != 0;
  f.fingerprint = r.get<uint64_t>();
  f.collectives = r.get<uint64_t>();
  const uint32_t world = r.get<uint32_t>();
  if (!r.ok || world > (1u << 20)) return std::nullopt;
  for (uint32_t i = 0; i < world && r.ok; ++i) {
    f.sent.push_back(r.get<uint64_t>());
    f.recvd.push_back(r.get<uint64_t>());
  }
  const uint32_t n = r.get<uint32_t>();
  if (!r.ok || n > 4096) return std::nullopt;
  for (uint32_t i = 0; i < n && r.ok; ++i) {
    FlightEntry e;
    e.op = r.get<uint64_t>();
    e.desc.kind = static_cast<CollectiveKind>(r.get<uint8_t>());
    e.desc.dtype = static_cast<DataType>(r.get<uint8_t>());
    e.desc.op = static_cast<ReduceOp>(r.get<uint8_t>());
    e.state = static_cast<FlightEntry::State>(r.get<uint8_t>() & 3);
    e.desc.root = r.get<int32_t>();
    e.desc.count = r.get<uint64_t>();
    e.desc.seq = r.get<uint64_t>();
    e.fingerprint = r.get<uint64_t>();
    e.submit_us = r.get<int64_t>();
    e.start_us = r.get<int64_t>();
    e.end_us = r.get<int64_t>();
    e.desc.site = r.get<uint32_t>();
    const uint16_t len = r.get<uint16_t>();
    if (!r.ok || r.at + len > bytes.size()) return std::nullopt;
    const std::string site = bytes.substr(r.at, len);
    bool printable = true;
    for (unsigned char ch : site) printable = printable && ch >= 0x20 && ch < 0x7f;
    if (e.desc.site && printable) call_site_id(site);  // so that describe() names a peer's site
    r.at += len;
    f.entries.push_back(e);
  }
  const uint32_t elen = r.get<uint32_t>();
  if (!r.ok || r.at + elen > bytes.size()) return std::nullopt;
  f.error = bytes.substr(r.at, elen);
  return f;
}

// The first collective (by number) that `a` and `b` both recorded and called
// differently; nullopt if their records agree where they overlap.
std::optional<uint64_t> first_difference(const FlightRecord& a, const FlightRecord& b) {
  std::optional<uint64_t> first;
  for (const auto& x : a.entries) {
    if (x.desc.kind == CollectiveKind::kSendRecv) continue;
    for (const auto& y : b.entries) {
      if (y.desc.kind == CollectiveKind::kSendRecv || y.desc.seq != x.desc.seq) continue;
      if (!(x.desc == y.desc) && (!first || x.desc.seq < *first)) first = x.desc.seq;
    }
  }
  return first;
}

namespace {
const FlightEntry* find_collective(const FlightRecord& r, uint64_t seq) {
  for (const auto& e : r.entries)
    if (e.desc.kind != CollectiveKind::kSendRecv && e.desc.seq == seq) return &e;
  return nullptr;
}
}  // namespace

// "the first call that differs is collective #5: rank 0 called ..., rank 1 called ..."
std::string name_difference(const std::vector<std::optional<FlightRecord>>& recs, uint64_t seq) {
  std::ostringstream os;
  os << "the first call that differs is collective #" << seq << ": ";
  bool any = false;
  for (const auto& r : recs) {
    if (!r) continue;
    os << (any ? ", " : "") << "rank " << r->rank;
    if (const FlightEntry* e = find_collective(*r, seq)) {
      OpDesc d = e->desc;
      std::string s = d.describe();
      os << " called " << s.substr(0, s.find(" as collective #"));
    } else if (r->collectives < seq) {
      os << " had called only " << r->collectives << " collective(s)";
    } else {
      os << " called it too long ago to be in its record";
    }
    any = true;
  }
  return os.str();
}

std::string what_each_was_doing(const std::vector<std::optional<FlightRecord>>& recs) {
  std::ostringstream os;
  const int64_t now = now_us();
  os << " What each rank was last doing (flight recorder, newest last):";
  for (size_t j = 0; j < recs.size(); ++j) {
    os << " [rank " << j << ": ";
    if (!recs[j]) {
      os << "no record: it did not answer through the store in time (dead, or not in a collective)]";
      continue;
    }
    const auto& es = recs[j]->entries;
    if (es.empty()) os << "no collective yet";
    const size_t from = es.size() > 3 ? es.size() - 3 : 0;
    for (size_t i = from; i < es.size(); ++i) os << (i > from ? "; " : "") << describe_entry(es[i], now);
    os << "]";
  }
  return os.str();
}


std::string compare_at_finalize(const FlightRecord& mine, const FlightRecord& r, size_t kept, bool& peer_failed) {
  const int me = mine.rank, j = r.rank;
  std::ostringstream problems;
  if (r.failed) {
    peer_failed = true;
    problems << " rank " << j << " failed earlier: " << r.error << ".";
    return problems.str();
  }
  if (r.fingerprint != mine.fingerprint || r.collectives != mine.collectives) {
    std::optional<uint64_t> d = first_difference(mine, r);
    problems << " rank " << me << " called " << mine.collectives << " collective(s), rank " << j << " "
             << r.collectives << ", and they differ: ";
    if (d) {
      problems << name_difference({mine, r}, *d) << ".";
    } else if (r.collectives != mine.collectives) {
      problems << "the first call that differs is collective #" << std::min(r.collectives, mine.collectives) + 1
               << ", which one rank never called.";
    } else {
      problems << "the first call that differs is older than the last " << kept << " operations kept.";
    }
  }
  if (static_cast<size_t>(me) < r.recvd.size() && mine.sent[j] > r.recvd[me]) {
    problems << " rank " << me << " sent " << mine.sent[j] - r.recvd[me] << " message(s) to rank " << j
             << " that rank " << j << " never received (unmatched send: every send needs a recv on its peer).";
  }
  if (static_cast<size_t>(me) < r.sent.size() && r.sent[me] > mine.recvd[j]) {
    problems << " rank " << j << " sent " << r.sent[me] - mine.recvd[j] << " message(s) to rank " << me
             << " that rank " << me << " never received (unmatched send: every send needs a recv on its peer).";
  }
  if (static_cast<size_t>(me) < r.sent.size() && r.sent[me] < mine.recvd[j]) {
    problems << " rank " << me << " received more messages from rank " << j << " than it sent.";
  }
  return problems.str();
}

}  // namespace cx::distributed
