// The spill planner's compiled core: from the global [P, N] count matrix to the chosen spill plan's
// split rows, spilled experts and token chunks. Step for step the algorithm of the Python reference
// (megatron_llep/planning/assignment.py, planner.py's candidate search, time_model.py's
// LayerTimeModel._candidate_phases), which tests/planning/test_spill_core.py holds it to, plan for
// plan. Compiled because the plan sits on every MoE layer's critical path between the count
// exchange and the token all-to-all: the Python planner takes 1-4 ms at N = 384, P = 64.
//
// Layouts are the reference's: split rows [8, rows] (slot, expert, dst, tokens, wave, source, kept,
// source row), token chunks [5, chunks] (expert, src, dst, count, slot). Splits are flat (expert,
// dst, tokens) parts in expert then dst order, where the reference has {expert: [(dst, tokens)]}.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;
using i64 = int64_t;

namespace {

struct Part {
    i64 expert, dst, tokens;
    bool operator==(const Part& o) const { return expert == o.expert && dst == o.dst && tokens == o.tokens; }
};

// the experts that leave their native rank, and where their tokens go
struct Splits {
    std::vector<Part> parts;  // by expert, then dst
    i64 experts = 0;
    bool empty() const { return experts == 0; }
    bool operator==(const Splits& o) const { return parts == o.parts; }
    bool operator!=(const Splits& o) const { return !(*this == o); }
};

// sorts parts by (expert, dst) and counts the experts
void finish(Splits& splits) {
    std::sort(splits.parts.begin(), splits.parts.end(), [](const Part& a, const Part& b) {
        return a.expert < b.expert || (a.expert == b.expert && a.dst < b.dst);
    });
    splits.experts = 0;
    for (size_t i = 0; i < splits.parts.size(); ++i)
        splits.experts += i == 0 || splits.parts[i].expert != splits.parts[i - 1].expert;
}

struct Layout {
    i64 ep, num_experts, local, m;
    bool has_budget;
    i64 budget;
    i64 ranks_per_node;      // for helpers and relays (ep: one node)
    i64 transport_per_node;  // token chunks matched inside nodes first: < ep, else 0
    bool repack, relay;
    std::vector<std::vector<i64>> holders;  // [expert]: ranks keeping a copy, ascending
    bool any_held;
    bool keep_bounded;
    std::vector<i64> keep_room;
    std::vector<i64> node_of;  // [rank]
};

struct Counts {
    const i64* data;  // [src, expert]
    i64 ep, n;
    std::vector<i64> node_rows;  // [node, expert]: tokens routed to each expert from inside each node
    std::unique_ptr<i64[]> by_expert;  // [expert, src]: an expert's column, gathered when first asked for
    mutable std::vector<char> gathered;
    const i64* column(i64 e) const {
        i64* out = by_expert.get() + e * ep;
        if (!gathered[e]) {
            for (i64 src = 0; src < ep; ++src) out[src] = data[src * n + e];
            gathered[e] = 1;
        }
        return out;
    }
};

bool holds(const Layout& lay, i64 e, i64 rank) {
    if (!lay.any_held) return false;
    const auto& h = lay.holders[e];
    return std::binary_search(h.begin(), h.end(), rank);
}

// ---------------------------------------------------------------- least-loaded assignment (LLA)

Splits repack(const Splits& splits, const std::vector<i64>& loads, const Layout& lay);

// node_supply[node * experts + e]: expert e's tokens routed inside each node (given: supply_first)
Splits least_loaded_assignment(const std::vector<i64>& loads, const std::vector<i64>& before, double capacity,
                               const Layout& lay, bool repacked, const std::vector<i64>* node_supply) {
    const bool supply_first = node_supply != nullptr;
    const i64 ep = lay.ep, n_exp = lay.num_experts, local = lay.local, m = lay.m;
    const i64 per_node = lay.ranks_per_node;
    const bool one_node = per_node >= ep;
    const i64 nodes = one_node ? 1 : ep / per_node;
    const auto& node_of = lay.node_of;
    std::vector<i64> effective(before);
    const double inf = std::numeric_limits<double>::infinity();
    const double budget = lay.has_budget ? double(lay.budget) : inf;
    const double slack_limit = std::min(capacity + double(m), budget);
    Splits splits;
    auto push_keys = [&](i64 g, std::vector<i64>& out) {  // ascending keys: descending loads, ties by id
        for (i64 e = g * local; e < (g + 1) * local; ++e)
            if (loads[e] > 0) out.push_back(-loads[e] * n_exp + e);
    };
    std::vector<char> overloaded(ep);
    std::vector<i64> to_visit;  // a min-heap of keys
    for (i64 g = 0; g < ep; ++g) {
        overloaded[g] = double(effective[g]) > capacity;
        if (overloaded[g]) push_keys(g, to_visit);
    }
    std::make_heap(to_visit.begin(), to_visit.end(), std::greater<i64>());
    // ranks with room for one more token (only they can be helpers), by (effective load, rank); a rank
    // that leaves never comes back, and only helpers' loads change while they are in it
    std::vector<i64> open_ranks;
    for (i64 g = 0; g < ep; ++g)
        if (capacity - double(effective[g]) >= 1) open_ranks.push_back(g);
    auto by_load = [&](i64 a, i64 b) { return effective[a] < effective[b] || (effective[a] == effective[b] && a < b); };
    std::sort(open_ranks.begin(), open_ranks.end(), by_load);

    std::vector<i64> candidates, reordered, later, unmet(nodes), node_order(nodes);
    std::vector<std::vector<i64>> by_node(nodes);
    std::vector<char> near(nodes);
    std::vector<std::pair<i64, i64>> parts;  // (dst, tokens) of the expert being placed
    auto add = [&](i64 dst, i64 tokens) {
        for (auto& part : parts)
            if (part.first == dst) {
                part.second += tokens;
                return;
            }
        parts.emplace_back(dst, tokens);
    };
    while (!to_visit.empty()) {
        std::pop_heap(to_visit.begin(), to_visit.end(), std::greater<i64>());
        const i64 key = to_visit.back();
        to_visit.pop_back();
        const i64 e = ((key % n_exp) + n_exp) % n_exp;
        const i64 load = loads[e];
        const i64 nat = e / local;
        effective[nat] -= load;
        const i64 room = i64(std::floor(capacity - double(effective[nat])));
        const i64 keep = room >= load ? load : (room > 0 ? room : 0);
        if (keep == load || (load - keep < m && double(effective[nat] + load) <= slack_limit)) {
            effective[nat] += load;
            continue;
        }
        parts.clear();
        i64 remaining = load;
        if (keep) {
            add(nat, keep);
            effective[nat] += keep;
            remaining -= keep;
        }
        // helpers in ascending effective load, native node first (or, supply first, node by node
        // in descending order of the expert's tokens routed there); then holders of a copy first
        candidates.assign(open_ranks.begin(), open_ranks.end());
        if (!one_node) {
            const i64 home = node_of[nat];
            reordered.clear();
            if (supply_first) {
                for (i64 node = 0; node < nodes; ++node) unmet[node] = (*node_supply)[node * n_exp + e];
                unmet[home] -= keep;
                for (i64 node = 0; node < nodes; ++node) node_order[node] = node;
                std::sort(node_order.begin(), node_order.end(), [&](i64 a, i64 b) {
                    return std::make_tuple(-unmet[a], a != home, a) < std::make_tuple(-unmet[b], b != home, b);
                });
                for (auto& bucket : by_node) bucket.clear();
                for (i64 g : candidates) by_node[node_of[g]].push_back(g);
                for (i64 node : node_order) reordered.insert(reordered.end(), by_node[node].begin(), by_node[node].end());
            } else {
                for (i64 g : candidates)
                    if (node_of[g] == home) reordered.push_back(g);
                for (i64 g : candidates)
                    if (node_of[g] != home) reordered.push_back(g);
            }
            candidates.swap(reordered);
        }
        const auto& hold = lay.holders[e];
        if (lay.any_held && !hold.empty()) {
            std::fill(near.begin(), near.end(), 0);
            for (i64 g : hold) near[node_of[g]] = 1;
            near[node_of[nat]] = 1;
            reordered.clear();
            for (i64 g : candidates)
                if (holds(lay, e, g)) reordered.push_back(g);
            for (i64 g : candidates)
                if (!holds(lay, e, g) && near[node_of[g]]) reordered.push_back(g);
            for (i64 g : candidates)
                if (!near[node_of[g]]) reordered.push_back(g);
            candidates.swap(reordered);
        }
        const i64 num = i64(candidates.size());
        i64 cursor = 0;
        while (remaining > 0) {
            const i64 need = m > 0 ? (remaining < m ? remaining : m) : 1;
            if (need < m) cursor = 0;  // a smaller final piece may fit ranks skipped for lack of room
            while (cursor < num && capacity - double(effective[candidates[cursor]]) < double(need)) ++cursor;
            i64 helper, take;
            if (cursor < num) {
                helper = candidates[cursor];
                const i64 r = i64(std::floor(capacity - double(effective[helper])));
                take = remaining < r ? remaining : r;
            } else {
                // nobody has room for a worthwhile chunk: the least-loaded rank takes up to cap + m
                // (at least one token), past that everything, up to the budget
                helper = i64(std::min_element(effective.begin(), effective.end()) - effective.begin());
                const double slack = slack_limit - double(effective[helper]);
                if (slack > 0)
                    take = std::min<i64>(remaining, std::max<i64>(i64(std::ceil(slack)), 1));
                else
                    take = lay.has_budget ? std::min<i64>(remaining, lay.budget - effective[helper]) : remaining;
            }
            add(helper, take);
            effective[helper] += take;
            const auto at = std::find(open_ranks.begin(), open_ranks.end(), helper);
            if (at != open_ranks.end()) {  // reorder it, or drop it when it has no room left
                open_ranks.erase(at);
                if (capacity - double(effective[helper]) >= 1)
                    open_ranks.insert(std::lower_bound(open_ranks.begin(), open_ranks.end(), helper, by_load), helper);
            }
            if (capacity - double(effective[helper]) < 1 && double(effective[helper]) > capacity &&
                !overloaded[helper]) {
                overloaded[helper] = 1;  // its own experts not visited yet are visited now
                later.clear();
                push_keys(helper, later);
                for (i64 k : later)
                    if (k > key) {
                        to_visit.push_back(k);
                        std::push_heap(to_visit.begin(), to_visit.end(), std::greater<i64>());
                    }
            }
            remaining -= take;
            if (remaining > 0 && remaining < m && double(effective[nat] + remaining) <= slack_limit) {
                add(nat, remaining);
                effective[nat] += remaining;
                remaining = 0;
            }
        }
        bool native_keeps = false;
        for (const auto& part : parts) native_keeps = native_keeps || part.first == nat;
        if (parts.size() > 1 || !native_keeps)
            for (const auto& [dst, tokens] : parts) splits.parts.push_back({e, dst, tokens});
    }
    finish(splits);
    if (repacked && lay.repack && !splits.empty()) return repack(splits, loads, lay);
    return splits;
}

// ---------------------------------------------------------------- repacking (MoonEP's rule)

struct Quota {
    i64 home, dst, tokens;
};
using Quotas = std::vector<Quota>;  // by home, then dst; one entry per pair

void merge_quotas(Quotas& quotas) {
    std::sort(quotas.begin(), quotas.end(), [](const Quota& a, const Quota& b) {
        return a.home < b.home || (a.home == b.home && a.dst < b.dst);
    });
    size_t out = 0;
    for (size_t i = 0; i < quotas.size(); ++i) {
        if (out && quotas[out - 1].home == quotas[i].home && quotas[out - 1].dst == quotas[i].dst)
            quotas[out - 1].tokens += quotas[i].tokens;
        else
            quotas[out++] = quotas[i];
    }
    quotas.resize(out);
}

i64 copies_of(const Splits& plan, const Layout& lay) {
    i64 copies = 0;
    for (const auto& p : plan.parts) copies += p.dst != p.expert / lay.local && !holds(lay, p.expert, p.dst);
    return copies;
}

i64 smallest_piece(const Splits& plan, const Layout& lay) {
    bool any = false;
    i64 smallest = 0;
    for (const auto& p : plan.parts)
        if (p.dst != p.expert / lay.local && (!any || p.tokens < smallest)) smallest = p.tokens, any = true;
    return smallest;
}

using Entry = std::pair<i64, i64>;

void heap_push(std::vector<Entry>& heap, Entry entry) {
    heap.push_back(entry);
    std::push_heap(heap.begin(), heap.end(), std::greater<Entry>());
}

Entry heap_pop(std::vector<Entry>& heap) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<Entry>());
    const Entry top = heap.back();
    heap.pop_back();
    return top;
}

// splits that send each home rank's quotas, filled per home from its experts: held experts into their
// holder's quota first, then the largest expert into the largest quota; the home keeps the rest
Splits fill_quotas(const Splits& splits, const Quotas& quotas, const std::vector<i64>& loads, const Layout& lay) {
    const i64 local = lay.local;
    std::vector<char> has_quota(lay.ep, 0);
    for (const auto& q : quotas) has_quota[q.home] = 1;
    Splits result;
    for (const auto& p : splits.parts)
        if (!has_quota[p.expert / local]) result.parts.push_back(p);
    std::vector<Entry> room, open_quotas, experts;  // room: (dst, tokens), by dst
    std::vector<i64> left(local);
    std::vector<Part> pieces;
    auto add_piece = [&](i64 e, i64 dst, i64 take) {
        for (auto& piece : pieces)
            if (piece.expert == e && piece.dst == dst) {
                piece.tokens += take;
                return;
            }
        pieces.push_back({e, dst, take});
    };
    for (size_t qb = 0; qb < quotas.size();) {
        const i64 home = quotas[qb].home;
        size_t qe = qb;
        room.clear();
        while (qe < quotas.size() && quotas[qe].home == home) {
            room.emplace_back(quotas[qe].dst, quotas[qe].tokens);
            ++qe;
        }
        qb = qe;
        const i64 first = home * local;
        for (i64 j = 0; j < local; ++j) left[j] = loads[first + j] > 0 ? loads[first + j] : 0;
        pieces.clear();
        auto room_of = [&](i64 dst) -> i64* {
            auto it = std::lower_bound(room.begin(), room.end(), Entry{dst, std::numeric_limits<i64>::min()});
            return it != room.end() && it->first == dst ? &it->second : nullptr;
        };
        bool any_held = false;
        for (i64 e = first; e < first + local && lay.any_held && !any_held; ++e) any_held = !lay.holders[e].empty();
        if (any_held) {
            std::vector<i64> by_load;
            for (i64 j = 0; j < local; ++j)
                if (loads[first + j] > 0) by_load.push_back(first + j);
            std::stable_sort(by_load.begin(), by_load.end(), [&](i64 a, i64 b) {
                return std::make_pair(-left[a - first], a) < std::make_pair(-left[b - first], b);
            });
            std::vector<Entry> holding;  // (expert, dst)
            for (i64 e : by_load)
                for (i64 dst : lay.holders[e])
                    if (room_of(dst)) holding.emplace_back(e, dst);
            std::stable_sort(holding.begin(), holding.end(),
                             [](const Entry& a, const Entry& b) { return a.second < b.second; });
            for (const auto& [e, dst] : holding) {
                i64& quota = *room_of(dst);
                if (quota > 0 && left[e - first] > 0) {
                    const i64 take = std::min(left[e - first], quota);
                    add_piece(e, dst, take);
                    left[e - first] -= take;
                    quota -= take;
                }
            }
        }
        open_quotas.clear(), experts.clear();
        for (const auto& [dst, q] : room)
            if (q > 0) heap_push(open_quotas, {-q, dst});
        for (i64 j = 0; j < local; ++j)
            if (left[j] > 0) heap_push(experts, {-left[j], first + j});
        while (!open_quotas.empty() && !experts.empty()) {
            const auto [q, dst] = heap_pop(open_quotas);
            const auto [t, e] = heap_pop(experts);
            const i64 take = q > t ? -q : -t;  // min(-q, -t)
            add_piece(e, dst, take);
            left[e - first] = -t - take;
            *room_of(dst) = -q - take;
            if (t + take < 0) heap_push(experts, {t + take, e});
            if (q + take < 0) heap_push(open_quotas, {q + take, dst});
        }
        std::vector<char> listed(local, 0);
        for (const auto& piece : pieces) {
            result.parts.push_back(piece);
            const i64 j = piece.expert - first;
            if (!listed[j] && left[j] > 0) result.parts.push_back({piece.expert, home, left[j]});
            listed[j] = 1;
        }
    }
    finish(result);
    return result;
}

// quotas from totals: the home rank with the most left to send fills the receiving rank with the most
// room (inside its node first when per_node), until all is sent
Quotas rebuild_quotas(const std::vector<Entry>& sending, const std::vector<Entry>& receiving, i64 per_node,
                      const Layout& lay) {
    std::vector<Entry> senders;
    for (const auto& [h, t] : sending)
        if (t > 0) heap_push(senders, {-t, h});
    const i64 pools_count = per_node ? (lay.ep + per_node - 1) / per_node : 1;
    std::vector<std::vector<Entry>> pools(pools_count);
    for (const auto& [d, t] : receiving)
        if (t > 0) heap_push(pools[per_node ? d / per_node : 0], {-t, d});
    Quotas rebuilt;
    while (!senders.empty()) {
        const auto [t, home] = heap_pop(senders);
        std::vector<Entry>* pool = &pools[per_node ? home / per_node : 0];
        if (pool->empty()) {  // none left in its node: the roomiest anywhere (most room, then lowest rank)
            pool = nullptr;
            for (auto& p : pools)
                if (!p.empty() && (!pool || p.front() < pool->front())) pool = &p;
        }
        const auto [r, dst] = heap_pop(*pool);
        const i64 amount = t > r ? -t : -r;
        rebuilt.push_back({home, dst, amount});
        if (t + amount < 0) heap_push(senders, {t + amount, home});
        if (r + amount < 0) heap_push(*pool, {r + amount, dst});
    }
    merge_quotas(rebuilt);
    return rebuilt;
}

// the same rank loads with fewer weight copies where possible (MoonEP's planning rule on the plan's
// own totals); the result with the fewest new copies wins, the plan's own on ties
Splits repack(const Splits& splits, const std::vector<i64>& loads, const Layout& lay) {
    const i64 local = lay.local, m = lay.m;
    Quotas quotas;
    for (const auto& p : splits.parts)
        if (p.dst != p.expert / local) quotas.push_back({p.expert / local, p.dst, p.tokens});
    merge_quotas(quotas);
    const i64 floor_piece = std::min(smallest_piece(splits, lay), m > 0 ? m : i64(1));
    i64 best_copies = copies_of(splits, lay);
    std::vector<i64> helper_ranks;
    for (const auto& q : quotas) helper_ranks.push_back(q.dst);
    std::sort(helper_ranks.begin(), helper_ranks.end());
    const i64 helpers = i64(std::unique(helper_ranks.begin(), helper_ranks.end()) - helper_ranks.begin());
    if (best_copies <= helpers) return splits;  // one copy per helper at most: nothing to gain

    Splits best;
    bool replaced = false;
    auto may_win = [&](const Quotas& candidate) {
        i64 needed = 0;
        for (const auto& q : candidate) {
            if (q.tokens <= 0) continue;
            if (q.tokens < floor_piece) return false;
            bool holds_one = false;
            for (i64 e = q.home * local; e < (q.home + 1) * local && lay.any_held && !holds_one; ++e)
                holds_one = holds(lay, e, q.dst);
            if (!holds_one) ++needed;
        }
        return needed < best_copies;
    };
    auto consider = [&](const Quotas& candidate) {
        if (!may_win(candidate)) return;
        Splits filled = fill_quotas(splits, candidate, loads, lay);
        const i64 copies = copies_of(filled, lay);
        if (copies < best_copies && smallest_piece(filled, lay) >= floor_piece) {
            best = std::move(filled);
            best_copies = copies;
            replaced = true;
        }
    };
    consider(quotas);
    std::vector<Entry> sending, receiving;
    for (const auto& q : quotas) {
        if (sending.empty() || sending.back().first != q.home) sending.emplace_back(q.home, 0);
        sending.back().second += q.tokens;
        receiving.emplace_back(q.dst, q.tokens);
    }
    std::sort(receiving.begin(), receiving.end());
    size_t out = 0;
    for (size_t i = 0; i < receiving.size(); ++i) {
        if (out && receiving[out - 1].first == receiving[i].first)
            receiving[out - 1].second += receiving[i].second;
        else
            receiving[out++] = receiving[i];
    }
    receiving.resize(out);
    bool overlap = false;
    for (const auto& [h, t] : sending)
        overlap = overlap || std::binary_search(helper_ranks.begin(), helper_ranks.begin() + helpers, h);
    if (sending.size() > 1 && !overlap) {
        // inside nodes first; then as if one node (the same when the ranks share one node)
        for (i64 per_node : {lay.ranks_per_node, i64(0)}) {
            if (best_copies <= helpers) break;
            consider(rebuild_quotas(sending, receiving, per_node, lay));
            if (lay.ranks_per_node >= lay.ep) break;
        }
    }
    return replaced ? best : splits;
}

// ---------------------------------------------------------------- split rows and weight copies

enum { SLOT, EXPERT, DST, TOKENS, WAVE, SOURCE, KEPT, SOURCE_ROW, FIELDS };
using Row = std::array<i64, FIELDS>;

struct Rows {
    std::vector<Row> rows;
    std::vector<i64> experts, owners;  // per slot: its expert and its candidate plan
};

i64 bit_length(i64 v) {
    i64 bits = 0;
    while (v > 0) ++bits, v >>= 1;
    return bits;
}

// waves per (source, helper): the d-th copy on a pair travels in wave bit_length(d)
void number_waves(Rows& out, const std::vector<i64>& copy_rows, std::vector<i64>& depth, i64 ep) {
    for (i64 i : copy_rows) {
        auto& row = out.rows[i];
        i64& d = depth[row[SOURCE] * ep + row[DST]];
        row[WAVE] = bit_length(d);
        ++d;
    }
    for (i64 i : copy_rows) depth[out.rows[i][SOURCE] * ep + out.rows[i][DST]] = 0;  // clean for the next use
}

// source, wave, kept flag and source row of one plan's new copies (rows[i], i in copy_rows, in expert
// order): kept in ascending (wave, expert, helper) order while the helper has keep_room; with relays,
// a copy bound for another node than its native rank's comes from that node's lowest holder, else
// from the first helper there whose copy is kept (which receives its own from the native rank)
void mark_copies(Rows& out, const std::vector<i64>& copy_rows, const Layout& lay, std::vector<i64>& depth) {
    auto& rows = out.rows;
    const i64 ep = lay.ep;
    for (i64 i : copy_rows) rows[i][SOURCE] = rows[i][EXPERT] / lay.local;
    number_waves(out, copy_rows, depth, ep);
    if (!lay.keep_bounded) {
        for (i64 i : copy_rows) rows[i][KEPT] = 1;
    } else {
        std::vector<i64> room(lay.keep_room);
        std::vector<i64> order(copy_rows);
        std::sort(order.begin(), order.end(), [&](i64 a, i64 b) {
            return std::make_tuple(rows[a][WAVE], rows[a][EXPERT], rows[a][DST]) <
                   std::make_tuple(rows[b][WAVE], rows[b][EXPERT], rows[b][DST]);
        });
        for (i64 i : order)
            if (room[rows[i][DST]] > 0) {
                --room[rows[i][DST]];
                rows[i][KEPT] = 1;
            }
    }
    if (!lay.relay) return;
    const auto& node_of = lay.node_of;
    // copies bound for another node, grouped by (expert, node); a group's members in expert, helper order
    std::vector<std::tuple<i64, i64, i64>> crossing;  // (expert, node, row)
    for (i64 i : copy_rows) {
        const i64 e = rows[i][EXPERT], d = rows[i][DST];
        if (node_of[d] != node_of[e / lay.local]) crossing.emplace_back(e, node_of[d], i);
    }
    std::stable_sort(crossing.begin(), crossing.end(), [](const auto& a, const auto& b) {
        return std::make_pair(std::get<0>(a), std::get<1>(a)) < std::make_pair(std::get<0>(b), std::get<1>(b));
    });
    bool relayed = false;
    for (size_t gb = 0; gb < crossing.size();) {
        const auto [e, node, first_row] = crossing[gb];
        size_t ge = gb;
        while (ge < crossing.size() && std::get<0>(crossing[ge]) == e && std::get<1>(crossing[ge]) == node) ++ge;
        i64 source = -1, source_row = -1;
        if (lay.any_held)
            for (i64 g : lay.holders[e])
                if (node_of[g] == node) {
                    source = g;
                    break;
                }
        if (source < 0) {
            for (size_t k = gb; k < ge && source_row < 0; ++k)
                if (rows[std::get<2>(crossing[k])][KEPT]) source_row = std::get<2>(crossing[k]);
        }
        if (source >= 0 || source_row >= 0) {
            if (source < 0) source = rows[source_row][DST];
            for (size_t k = gb; k < ge; ++k) {
                const i64 i = std::get<2>(crossing[k]);
                if (i != source_row) {
                    rows[i][SOURCE] = source;
                    rows[i][SOURCE_ROW] = source_row;
                    relayed = true;
                }
            }
        }
        gb = ge;
    }
    if (relayed) {
        number_waves(out, copy_rows, depth, ep);
        for (i64 i : copy_rows)
            if (rows[i][SOURCE_ROW] >= 0) rows[i][WAVE] = std::max(rows[i][WAVE], rows[rows[i][SOURCE_ROW]][WAVE] + 1);
    }
}

// the split rows of one or more candidate plans; slots count up across the plans, within a plan by
// expert id, destinations ascending within a slot
Rows split_rows(const std::vector<const Splits*>& candidates, const Layout& lay) {
    Rows out;
    std::vector<i64> depth(lay.ep * lay.ep, 0), copy_rows;
    size_t total = 0;
    for (const Splits* s : candidates) total += s->parts.size();
    out.rows.reserve(total);
    for (size_t k = 0; k < candidates.size(); ++k) {
        copy_rows.clear();
        const auto& parts = candidates[k]->parts;
        for (size_t i = 0; i < parts.size(); ++i) {
            const Part& p = parts[i];
            if (i == 0 || p.expert != parts[i - 1].expert) {
                out.experts.push_back(p.expert);
                out.owners.push_back(i64(k));
            }
            if (p.dst != p.expert / lay.local && !holds(lay, p.expert, p.dst)) copy_rows.push_back(i64(out.rows.size()));
            out.rows.push_back({i64(out.owners.size()) - 1, p.expert, p.dst, p.tokens, 0, -1, 0, -1});
        }
        mark_copies(out, copy_rows, lay, depth);
    }
    return out;
}

// ---------------------------------------------------------------- token transport

enum { CHUNK_EXPERT, CHUNK_SRC, CHUNK_DST, CHUNK_COUNT, CHUNK_SLOT, CHUNK_FIELDS };
using Chunk = std::array<i64, CHUNK_FIELDS>;

using Chunks = std::vector<Chunk>;

std::vector<i64> water_fill(const std::vector<i64>& levels, const std::vector<i64>& caps, i64 amount) {
    const size_t n = levels.size();
    if (n == 1) return {amount};
    std::vector<std::pair<i64, int>> events;
    events.reserve(2 * n);
    for (size_t i = 0; i < n; ++i) {
        events.emplace_back(levels[i], 1);
        events.emplace_back(levels[i] + caps[i], -1);
    }
    std::sort(events.begin(), events.end());
    i64 filled = 0, slope = 0, at = events[0].first, water = 0;
    bool found = false;
    for (const auto& [position, change] : events) {
        if (position != at) {
            const i64 reached = filled + slope * (position - at);
            if (reached >= amount) {
                // floor division as Python's //: slope > 0 here, amount - filled >= 0
                water = at + (amount - filled) / slope;
                found = true;
                break;
            }
            filled = reached;
            at = position;
        }
        slope += change;
    }
    if (!found) water = at;
    std::vector<i64> rise(n);
    i64 left = amount;
    for (size_t i = 0; i < n; ++i) {
        rise[i] = std::min(caps[i], std::max<i64>(0, water - levels[i]));
        left -= rise[i];
    }
    for (size_t i = 0; i < n && left != 0; ++i)
        if (levels[i] + rise[i] == water && rise[i] < caps[i]) {
            ++rise[i];
            --left;
        }
    return rise;
}

// Per split row, how many of the rows it still needs come from other nodes. Per (slot, node) group,
// that is the group's need beyond what the node supplies (matched); it is given to the group's
// destinations by water-filling their rows arriving across nodes so far (plain EP's for the experts
// the plan does not spill, then the plan's slots before this one), each at most its need.
std::vector<i64> crossing_by_level(const Counts& counts, const std::vector<i64>& loads, const std::vector<i64>& need,
                                   const std::vector<i64>& demand_group, const std::vector<i64>& matched,
                                   const Rows& rows, i64 per_node, const Layout& lay) {
    const i64 ep = counts.ep, n_exp = counts.n, nodes = ep / per_node, local = lay.local;
    const auto& experts = rows.experts;
    const auto& slot_candidate = rows.owners;
    const i64 slots = i64(experts.size());
    std::vector<i64> excess(slots * nodes, 0);
    for (size_t r = 0; r < need.size(); ++r) excess[demand_group[r]] += need[r];
    bool any = false;
    for (i64 g = 0; g < slots * nodes; ++g) {
        excess[g] -= matched[g];
        any = any || excess[g] > 0;
    }
    std::vector<i64> crossing(need.size(), 0);
    if (!any) return crossing;
    // plain EP's rows arriving across nodes, per expert and per rank
    std::vector<i64> from_other_nodes(n_exp), plain_in(ep, 0);
    for (i64 e = 0; e < n_exp; ++e) {
        from_other_nodes[e] = loads[e] - counts.node_rows[((e / local) / per_node) * n_exp + e];
        plain_in[e / local] += from_other_nodes[e];
    }
    std::vector<i64> level, levels, caps, members;
    i64 owner = -1;
    size_t start = 0;
    for (i64 g = 0; g < slots * nodes; ++g) {
        while (start < demand_group.size() && demand_group[start] < g) ++start;
        if (excess[g] <= 0) continue;
        const i64 slot = g / nodes;
        if (slot_candidate[slot] != owner) {  // a new plan: its unspilled experts' plain-EP arrivals
            owner = slot_candidate[slot];
            level = plain_in;
            for (i64 s = 0; s < slots; ++s)
                if (slot_candidate[s] == owner) level[experts[s] / local] -= from_other_nodes[experts[s]];
        }
        levels.clear(), caps.clear(), members.clear();
        for (size_t r = start; r < demand_group.size() && demand_group[r] == g; ++r)
            if (need[r] > 0) {
                members.push_back(i64(r));
                levels.push_back(level[rows.rows[r][DST]]);
                caps.push_back(need[r]);
            }
        const auto rise = water_fill(levels, caps, excess[g]);
        for (size_t i = 0; i < members.size(); ++i) {
            crossing[members[i]] = rise[i];
            level[rows.rows[members[i]][DST]] += rise[i];
        }
    }
    return crossing;
}

// chunks that match supply (slot-major, slots [slot_begin, slot_end)) to the need of rows
// [row_begin, row_end) in order (north-west corner); both sum alike per slot
void northwest(const std::vector<i64>& supply, const std::vector<i64>& need, const Rows& rows, i64 ep,
               i64 slot_begin, i64 slot_end, i64 row_begin, i64 row_end, Chunks& out) {
    i64 i = slot_begin * ep, j = row_begin;
    const i64 ns = slot_end * ep, nr = row_end;
    i64 left_supply = 0, left_need = 0;
    auto next_supply = [&]() {
        while (i < ns && supply[i] == 0) ++i;
        if (i < ns) left_supply = supply[i];
    };
    auto next_need = [&]() {
        while (j < nr && need[j] <= 0) ++j;
        if (j < nr) left_need = need[j];
    };
    next_supply();
    next_need();
    while (i < ns && j < nr) {
        const i64 take = std::min(left_supply, left_need);
        const i64 slot = i / ep;
        out.push_back({rows.experts[slot], i - slot * ep, rows.rows[j][DST], take, slot});
        left_supply -= take;
        left_need -= take;
        if (left_supply == 0) ++i, next_supply();
        if (left_need == 0) ++j, next_need();
    }
}

// Which source sends how many tokens of each spilled expert to each destination: each destination
// first takes its own routed tokens; across nodes (per_node < ep) then tokens routed inside its
// node, shared among the node's sources in proportion to what each has left, the rest water-filled
// over the node's destinations by rows arriving across nodes; the rest in rank order.
//
// Decided for all candidates at once (the amounts), made into chunks for one (chunks()). Per (slot,
// node) group the inside-node phase leaves either no supply or no need, so its chunks stay inside
// nodes and the last phase's all cross them: what pricing needs of the chunks (traffic()) follows
// from the amounts, whatever chunks they make.
struct Transport {
    std::vector<i64> own;                       // [row]: the destination's own routed tokens it computes
    std::vector<i64> inside_supply, inside_need;  // [slot * ep + src], [row]: the inside-node phase
    std::vector<i64> supply, need;              // [slot * ep + src], [row]: what is left, rank order
    bool by_node = false;                       // whether the inside-node phase ran

    Transport(const Counts& counts, const std::vector<i64>& loads, const Rows& rows, const Layout& lay) {
        const i64 ep = counts.ep, n_exp = counts.n;
        const i64 slots = i64(rows.experts.size());
        const size_t nr = rows.rows.size();
        supply.resize(slots * ep);
        i64 supply_left = 0;
        for (i64 s = 0; s < slots; ++s) {
            std::copy_n(counts.column(rows.experts[s]), ep, supply.begin() + s * ep);
            supply_left += loads[rows.experts[s]];
        }
        own.resize(nr);
        need.resize(nr);
        const i64 per_node = lay.transport_per_node > 0 ? lay.transport_per_node : ep;
        const i64 nodes = ep / per_node;
        std::vector<i64> supply_total;
        if (per_node < ep) {
            supply_total.resize(slots * nodes);
            for (i64 s = 0; s < slots; ++s)
                for (i64 node = 0; node < nodes; ++node)
                    supply_total[s * nodes + node] = counts.node_rows[node * n_exp + rows.experts[s]];
        }
        for (size_t r = 0; r < nr; ++r) {
            const auto& row = rows.rows[r];
            i64& available = supply[row[SLOT] * ep + row[DST]];
            own[r] = std::min(available, row[TOKENS]);
            available -= own[r];
            supply_left -= own[r];
            need[r] = row[TOKENS] - own[r];
            if (per_node < ep) supply_total[row[SLOT] * nodes + row[DST] / per_node] -= own[r];
        }
        if (per_node < ep && supply_left > 0) {
            const i64 groups = slots * nodes;
            std::vector<i64> demand_total(groups, 0), demand_group(nr), matched(groups);
            for (size_t r = 0; r < nr; ++r) {
                demand_group[r] = rows.rows[r][SLOT] * nodes + rows.rows[r][DST] / per_node;
                demand_total[demand_group[r]] += need[r];
            }
            for (i64 g = 0; g < groups; ++g) matched[g] = std::min(supply_total[g], demand_total[g]);
            // each source's part of its group's match, in proportion to its supply (cumulative
            // rounding: the parts sum to the match exactly)
            inside_supply.assign(slots * ep, 0);
            i64 taken = 0;
            for (i64 g = 0; g < groups; ++g) {
                if (matched[g] == 0) continue;
                taken += matched[g];
                if (matched[g] == supply_total[g]) {  // all of it: upto * total / total
                    std::copy(supply.begin() + g * per_node, supply.begin() + (g + 1) * per_node,
                              inside_supply.begin() + g * per_node);
                    continue;
                }
                const i64 total = supply_total[g];
                i64 upto = 0, before = 0;
                for (i64 k = g * per_node; k < (g + 1) * per_node; ++k) {
                    upto += supply[k];
                    const i64 scaled = upto * matched[g] / total;
                    inside_supply[k] = scaled - before;
                    before = scaled;
                }
            }
            const auto crossing = crossing_by_level(counts, loads, need, demand_group, matched, rows, per_node, lay);
            if (taken > 0) {
                by_node = true;
                inside_need.resize(nr);
                for (size_t r = 0; r < nr; ++r) {
                    inside_need[r] = need[r] - crossing[r];
                    need[r] = crossing[r];
                }
                for (i64 k = 0; k < slots * ep; ++k) supply[k] -= inside_supply[k];
            }
        }
    }

    // token rows out of and into each rank, [candidate, link class, rank]
    void traffic(const Rows& rows, const Layout& lay, i64 k, std::vector<i64>& out, std::vector<i64>& in) const {
        const i64 ep = lay.ep, slots = i64(rows.experts.size());
        out.assign(2 * k * ep, 0);
        in.assign(2 * k * ep, 0);
        const bool nodes = lay.ranks_per_node < ep;
        if (nodes && !(lay.transport_per_node > 0 && lay.transport_per_node < ep)) {
            // tokens matched in rank order across nodes: each chunk's link decides
            const auto& node_of = lay.node_of;
            for (const auto& c : chunks(rows, ep, 0, slots, 0, i64(rows.rows.size()))) {
                if (c[CHUNK_SRC] == c[CHUNK_DST]) continue;
                const i64 base = 2 * rows.owners[c[CHUNK_SLOT]] * ep + (node_of[c[CHUNK_SRC]] != node_of[c[CHUNK_DST]] ? ep : 0);
                out[base + c[CHUNK_SRC]] += c[CHUNK_COUNT];
                in[base + c[CHUNK_DST]] += c[CHUNK_COUNT];
            }
            return;
        }
        const i64 last_class = nodes ? ep : 0;  // the last phase's links: across nodes when there are several
        for (i64 s = 0; s < slots; ++s) {
            i64* o = out.data() + 2 * rows.owners[s] * ep;
            const i64* rest = supply.data() + s * ep;
            for (i64 src = 0; src < ep; ++src) o[last_class + src] += rest[src];
            if (by_node) {
                const i64* inside = inside_supply.data() + s * ep;
                for (i64 src = 0; src < ep; ++src) o[src] += inside[src];
            }
        }
        for (size_t r = 0; r < rows.rows.size(); ++r) {
            i64* i = in.data() + 2 * rows.owners[rows.rows[r][SLOT]] * ep;
            i[last_class + rows.rows[r][DST]] += need[r];
            if (by_node) i[rows.rows[r][DST]] += inside_need[r];
        }
    }

    // the chunks of the slots [slot_begin, slot_end), whose rows are [row_begin, row_end): the tokens
    // that stay, then the inside-node phase's, then the rest's (the reference's order)
    Chunks chunks(const Rows& rows, i64 ep, i64 slot_begin, i64 slot_end, i64 row_begin, i64 row_end) const {
        Chunks out;
        out.reserve((row_end - row_begin) + (slot_end - slot_begin) * ep);
        for (i64 r = row_begin; r < row_end; ++r)
            if (own[r] > 0) {
                const auto& row = rows.rows[r];
                out.push_back({row[EXPERT], row[DST], row[DST], own[r], row[SLOT]});
            }
        if (by_node) northwest(inside_supply, inside_need, rows, ep, slot_begin, slot_end, row_begin, row_end, out);
        northwest(supply, need, rows, ep, slot_begin, slot_end, row_begin, row_end, out);
        return out;
    }
};

// ---------------------------------------------------------------- the layer time model

struct TimeModel {
    double gemm_a, gemm_b, token_bytes, weight_bytes, intra_gbps, inter_gbps, latency;
    double link_time(double bytes, bool inter) const {
        if (bytes <= 0) return 0.0;
        return latency + bytes / ((inter ? inter_gbps : intra_gbps) * 1e9);
    }
};

struct Pricing {
    i64 ep, local, per_node;
    std::vector<double> expert_gemm, ep_compute;
    std::vector<double> ep_out, ep_in;  // plain EP's token rows, [class * ep + rank]
};

// numpy's float summation order (pairwise in blocks of 8), so that a rank's GEMM time is the same
// number the Python reference computes and ties between plans break alike
double pairwise_sum(const double* a, i64 n) {
    if (n < 8) {
        double res = 0.0;
        for (i64 i = 0; i < n; ++i) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; ++j) r[j] = a[j];
        i64 i = 8;
        for (; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; ++j) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) res += a[i];
        return res;
    }
    i64 n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

Pricing make_pricing(const Counts& counts, const std::vector<i64>& loads, const Layout& lay, const TimeModel& tm) {
    Pricing p;
    const i64 ep = counts.ep, n_exp = counts.n, local = lay.local;
    p.ep = ep, p.local = local, p.per_node = std::min(lay.ranks_per_node, ep);
    p.expert_gemm.resize(n_exp);
    for (i64 e = 0; e < n_exp; ++e) p.expert_gemm[e] = loads[e] > 0 ? tm.gemm_a + tm.gemm_b * double(loads[e]) : 0.0;
    p.ep_compute.assign(ep, 0.0);
    for (i64 r = 0; r < ep; ++r) p.ep_compute[r] = pairwise_sum(p.expert_gemm.data() + r * local, local);
    std::vector<i64> ep_out(2 * ep, 0), ep_in(2 * ep, 0);
    for (i64 src = 0; src < ep; ++src) {
        const i64* row = counts.data + src * n_exp;
        for (i64 dst = 0; dst < ep; ++dst) {
            if (dst == src) continue;
            i64 c = 0;
            for (i64 e = dst * local; e < (dst + 1) * local; ++e) c += row[e];
            const i64 cls = lay.node_of[src] != lay.node_of[dst] ? ep : 0;
            ep_out[cls + src] += c;
            ep_in[cls + dst] += c;
        }
    }
    p.ep_out.assign(ep_out.begin(), ep_out.end());
    p.ep_in.assign(ep_in.begin(), ep_in.end());
    return p;
}

double plain_ep_time(const Pricing& p, const TimeModel& tm) {
    double peak[2] = {0.0, 0.0};
    for (int cls = 0; cls < 2; ++cls)
        for (i64 r = 0; r < p.ep; ++r)
            peak[cls] = std::max(peak[cls], std::max(p.ep_out[cls * p.ep + r], p.ep_in[cls * p.ep + r]));
    const double combine = std::max(tm.link_time(peak[0] * tm.token_bytes, false),
                                    tm.link_time(peak[1] * tm.token_bytes, true));
    const double compute = *std::max_element(p.ep_compute.begin(), p.ep_compute.end());
    return combine + compute + combine;  // dispatch moves the same tokens as the combine
}

// the predicted layer time of each of k candidate plans (LayerTimeModel._candidate_phases): dispatch,
// then each rank's native GEMMs and its borrowed ones wave by wave as the weight copies arrive, then
// the combine; every rank's links in parallel, links inside a node and across nodes separately
std::vector<double> candidate_times(const Pricing& p, const TimeModel& tm, const Counts& counts,
                                    const std::vector<i64>& loads, const Rows& rows, const std::vector<i64>& traffic_out,
                                    const std::vector<i64>& traffic_in, i64 k,
                                    const Layout& lay) {
    const i64 ep = p.ep, local = p.local;
    const i64 slots = i64(rows.experts.size());
    const auto& node_of = lay.node_of;
    // GEMMs: each spilled expert's leaves its native rank; its parts' are added where they run
    std::vector<double> removed(k * ep, 0.0), added(k * ep, 0.0);
    for (i64 s = 0; s < slots; ++s) {
        const i64 e = rows.experts[s];
        removed[rows.owners[s] * ep + e / local] += p.expert_gemm[e];
    }
    for (const auto& row : rows.rows)
        added[rows.owners[row[SLOT]] * ep + row[DST]] += tm.gemm_a + tm.gemm_b * double(row[TOKENS]);
    // tokens: the spilled experts' plain-EP traffic out, the plan's chunks in (whole token counts:
    // exact in any order)
    std::vector<i64> moved_out(2 * k * ep, 0), moved_in(2 * k * ep, 0);
    for (i64 s = 0; s < slots; ++s) {
        const i64 e = rows.experts[s], owner = e / local, home = node_of[owner];
        const i64* column = counts.column(e);
        i64* out = moved_out.data() + 2 * rows.owners[s] * ep;
        i64* in = moved_in.data() + 2 * rows.owners[s] * ep;
        const i64 first = home * p.per_node, last = first + p.per_node;
        for (i64 src = 0; src < first; ++src) out[ep + src] += column[src];
        for (i64 src = first; src < last; ++src) out[src] += column[src];
        for (i64 src = last; src < ep; ++src) out[ep + src] += column[src];
        out[owner] -= column[owner];  // its own tokens never moved
        const i64 inside = counts.node_rows.empty() ? loads[e] : counts.node_rows[home * counts.n + e];
        in[owner] += inside - column[owner];
        in[ep + owner] += loads[e] - inside;
    }
    std::vector<double> compute(k * ep), out(2 * k * ep), into(2 * k * ep), tokens(k), latest(k);
    for (i64 c = 0; c < k; ++c) {
        for (i64 r = 0; r < ep; ++r) {
            double v = p.ep_compute[r] - removed[c * ep + r];
            v += added[c * ep + r];
            compute[c * ep + r] = v;
        }
        double peak[2] = {0.0, 0.0};
        for (int cls = 0; cls < 2; ++cls)
            for (i64 r = 0; r < ep; ++r) {
                const i64 i = (2 * c + cls) * ep + r;
                out[i] = (p.ep_out[cls * ep + r] + double(traffic_out[i] - moved_out[i])) * tm.token_bytes;
                into[i] = (p.ep_in[cls * ep + r] + double(traffic_in[i] - moved_in[i])) * tm.token_bytes;
                peak[cls] = std::max(peak[cls], std::max(out[i], into[i]));
            }
        tokens[c] = std::max(tm.link_time(peak[0], false), tm.link_time(peak[1], true));
        latest[c] = tokens[c] + *std::max_element(compute.begin() + c * ep, compute.begin() + (c + 1) * ep);
    }
    // weights: each wave's borrowed GEMMs start once the wave's copies are in; a copy shares its
    // source's and helper's links with the tokens, after them and after the earlier waves
    std::vector<i64> copy;
    i64 waves = 0;
    for (size_t r = 0; r < rows.rows.size(); ++r)
        if (rows.rows[r][SOURCE] >= 0) {
            copy.push_back(i64(r));
            waves = std::max(waves, rows.rows[r][WAVE] + 1);
        }
    if (waves) {
        const i64 size = 2 * k * ep;
        std::vector<i64> sent(size * waves, 0), got(size * waves, 0), sender(copy.size()), receiver(copy.size());
        for (size_t i = 0; i < copy.size(); ++i) {
            const auto& row = rows.rows[copy[i]];
            const i64 base = rows.owners[row[SLOT]] * ep, giver = row[SOURCE], helper = row[DST];
            const i64 inter = node_of[giver] != node_of[helper] ? ep : 0;
            sender[i] = 2 * base + inter + giver;
            receiver[i] = 2 * base + inter + helper;
            ++sent[sender[i] * waves + row[WAVE]];
            ++got[receiver[i] * waves + row[WAVE]];
        }
        if (waves > 1)
            for (i64 l = 0; l < size; ++l)
                for (i64 w = 1; w < waves; ++w) {
                    sent[l * waves + w] += sent[l * waves + w - 1];
                    got[l * waves + w] += got[l * waves + w - 1];
                }
        std::vector<double> arrival(copy.size());
        std::vector<i64> position(rows.rows.size(), -1);
        for (size_t i = 0; i < copy.size(); ++i) {
            const auto& row = rows.rows[copy[i]];
            position[copy[i]] = i64(i);
            const double busy = std::max(out[sender[i]] + double(sent[sender[i] * waves + row[WAVE]]) * tm.weight_bytes,
                                         into[receiver[i]] + double(got[receiver[i] * waves + row[WAVE]]) * tm.weight_bytes);
            const bool inter = node_of[row[SOURCE]] != node_of[row[DST]];
            arrival[i] = tm.latency + busy / ((inter ? tm.inter_gbps : tm.intra_gbps) * 1e9);
        }
        // a relay forwards its copy once it has it, over its link inside the node
        const std::vector<double> direct(arrival);
        for (size_t i = 0; i < copy.size(); ++i) {
            const i64 up = rows.rows[copy[i]][SOURCE_ROW];
            if (up >= 0) arrival[i] = std::max(arrival[i], direct[position[up]] + tm.link_time(tm.weight_bytes, false));
        }
        // a wave's GEMMs and every later wave's run back to back once it has arrived
        std::vector<double> remaining(k * ep * waves, 0.0);
        for (size_t i = 0; i < copy.size(); ++i) {
            const auto& row = rows.rows[copy[i]];
            remaining[(rows.owners[row[SLOT]] * ep + row[DST]) * waves + row[WAVE]] +=
                tm.gemm_a + tm.gemm_b * double(row[TOKENS]);
        }
        for (i64 l = 0; l < k * ep; ++l) {
            double acc = 0.0;
            for (i64 w = waves - 1; w >= 0; --w) {
                acc += remaining[l * waves + w];
                remaining[l * waves + w] = acc;
            }
        }
        for (size_t i = 0; i < copy.size(); ++i) {
            const auto& row = rows.rows[copy[i]];
            const i64 c = rows.owners[row[SLOT]];
            latest[c] = std::max(latest[c], arrival[i] + remaining[(c * ep + row[DST]) * waves + row[WAVE]]);
        }
    }
    std::vector<double> times(k);
    for (i64 c = 0; c < k; ++c) times[c] = tokens[c] + (latest[c] - tokens[c]) + tokens[c];
    return times;
}

// whether the busiest native rank's new weight copies (per link class; one per expert and node across
// nodes when copies are relayed) take more than `gate` of the GEMM time of the plan's most loaded rank
bool weight_copies_weigh(const Splits& splits, const std::vector<i64>& before, const std::vector<i64>& loads,
                         const Layout& lay, const TimeModel& tm, double gate) {
    const auto& node_of = lay.node_of;
    std::vector<i64> copies(2 * lay.ep, 0), after(before), relayed_nodes;  // copies[2 * native + inter]
    for (size_t i = 0; i < splits.parts.size(); ++i) {
        const Part& p = splits.parts[i];
        const i64 native = p.expert / lay.local;
        if (i == 0 || p.expert != splits.parts[i - 1].expert) {
            after[native] -= loads[p.expert];
            relayed_nodes.clear();
        }
        after[p.dst] += p.tokens;
        if (p.dst != native && !holds(lay, p.expert, p.dst)) {
            const bool inter = node_of[native] != node_of[p.dst];
            if (inter && lay.relay) {
                if (std::find(relayed_nodes.begin(), relayed_nodes.end(), node_of[p.dst]) != relayed_nodes.end()) continue;
                relayed_nodes.push_back(node_of[p.dst]);
            }
            ++copies[2 * native + inter];
        }
    }
    double sending = 0.0;
    for (i64 i = 0; i < 2 * lay.ep; ++i)
        if (copies[i]) sending = std::max(sending, tm.link_time(double(copies[i]) * tm.weight_bytes, i % 2 == 1));
    return sending > gate * tm.gemm_b * double(*std::max_element(after.begin(), after.end()));
}

// [F, n]: one field per line, as the reference lays out rows and chunks
template <size_t F>
py::array_t<i64> to_fields(const std::vector<std::array<i64, F>>& items) {
    const size_t n = items.size();
    py::array_t<i64> out({i64(F), i64(n)});
    i64* data = out.mutable_data();
    for (size_t j = 0; j < n; ++j)
        for (size_t f = 0; f < F; ++f) data[f * n + j] = items[j][f];
    return out;
}

}  // namespace

// The spill plan of one MoE layer step (planner._spill_plan): None when nothing spills,
// (capacity, None, None, None) when plain EP is predicted fastest, else the chosen plan's
// (capacity, split rows [8, R], spilled experts [S], token chunks [5, C]).
py::object spill_plan(py::array_t<i64, py::array::c_style | py::array::forcecast> counts_array,
                      py::array_t<i64, py::array::c_style | py::array::forcecast> loads_array,
                      py::array_t<i64, py::array::c_style | py::array::forcecast> before_array, i64 local,
                      double capacity, i64 min_chunk_tokens, py::object budget, i64 ranks_per_node,
                      i64 transport_per_node, bool repack_copies, bool relay,
                      py::array_t<i64, py::array::c_style | py::array::forcecast> held_experts,
                      py::array_t<i64, py::array::c_style | py::array::forcecast> held_ranks, py::object keep_room,
                      bool cost_aware, py::object pricing, std::vector<double> rungs, double search_gate,
                      i64 search_slots) {
    const i64 ep = counts_array.shape(0), n_exp = counts_array.shape(1);
    if (loads_array.size() != n_exp || before_array.size() != ep || ranks_per_node <= 0 || local * ep != n_exp)
        throw std::invalid_argument("spill_plan: counts, loads, before and the layout disagree");
    Counts counts{counts_array.data(), ep, n_exp, {}, std::unique_ptr<i64[]>(new i64[ep * n_exp]),
                  std::vector<char>(n_exp, 0)};
    const std::vector<i64> loads(loads_array.data(), loads_array.data() + n_exp);
    const std::vector<i64> before(before_array.data(), before_array.data() + ep);
    Layout lay;
    lay.ep = ep, lay.num_experts = n_exp, lay.local = local, lay.m = min_chunk_tokens;
    lay.has_budget = !budget.is_none();
    lay.budget = lay.has_budget ? budget.cast<i64>() : 0;
    lay.ranks_per_node = ranks_per_node, lay.transport_per_node = transport_per_node;
    lay.repack = repack_copies, lay.relay = relay;
    lay.node_of.resize(ep);
    for (i64 g = 0; g < ep; ++g) lay.node_of[g] = g / ranks_per_node;
    lay.any_held = held_experts.size() > 0;
    lay.holders.assign(n_exp, {});
    for (py::ssize_t i = 0; i < held_experts.size(); ++i) lay.holders[held_experts.data()[i]].push_back(held_ranks.data()[i]);
    for (auto& h : lay.holders) std::sort(h.begin(), h.end());
    lay.keep_bounded = !keep_room.is_none();
    if (lay.keep_bounded) lay.keep_room = keep_room.cast<std::vector<i64>>();
    if (ranks_per_node < ep) {  // tokens routed to each expert from inside each node
        const i64 nodes = ep / ranks_per_node;
        counts.node_rows.assign(nodes * n_exp, 0);
        for (i64 src = 0; src < ep; ++src) {
            const i64* __restrict row = counts.data + src * n_exp;
            i64* __restrict node_row = counts.node_rows.data() + lay.node_of[src] * n_exp;
            for (i64 e = 0; e < n_exp; ++e) node_row[e] += row[e];
        }
    }

    const Splits splits = least_loaded_assignment(loads, before, capacity, lay, true, nullptr);
    if (splits.empty()) return py::none();
    std::vector<Splits> extra;
    std::vector<double> capacities{capacity};
    Rows rows;
    std::unique_ptr<Transport> amounts;
    i64 best = 0;
    if (!cost_aware) {
        rows = split_rows({&splits}, lay);
        amounts = std::make_unique<Transport>(counts, loads, rows, lay);
    } else {
        const auto params = pricing.cast<std::vector<double>>();
        const TimeModel tm{params[0], params[1], params[2], params[3], params[4], params[5], params[6]};
        extra.reserve(rungs.size() + 1);
        if (weight_copies_weigh(splits, before, loads, lay, tm, search_gate)) {
            // raised capacities: fewer, fuller helpers (not repacked: planner time)
            const double ceiling = double(*std::max_element(before.begin(), before.end()));
            i64 slots = splits.experts, last = splits.experts;
            for (double factor : rungs) {
                const double raised = lay.has_budget ? std::min(capacity * factor, double(lay.budget)) : capacity * factor;
                if (raised >= ceiling || raised <= capacities.back() || slots + last > search_slots) break;
                Splits more = least_loaded_assignment(loads, before, raised, lay, false, nullptr);
                if (more.empty()) break;
                capacities.push_back(raised);
                slots += more.experts;
                last = more.experts;
                extra.push_back(std::move(more));
            }
        }
        if (transport_per_node > 0 && transport_per_node < ep) {
            // helpers where the expert's tokens are routed, rather than native node first
            Splits matched = least_loaded_assignment(loads, before, capacity, lay, false, &counts.node_rows);
            if (!matched.empty() && matched != splits) {
                capacities.push_back(capacity);
                extra.push_back(std::move(matched));
            }
        }
        std::vector<const Splits*> candidates{&splits};
        for (const auto& s : extra) candidates.push_back(&s);
        const i64 k = i64(candidates.size());
        rows = split_rows(candidates, lay);
        amounts = std::make_unique<Transport>(counts, loads, rows, lay);
        std::vector<i64> traffic_out, traffic_in;
        amounts->traffic(rows, lay, k, traffic_out, traffic_in);
        const Pricing p = make_pricing(counts, loads, lay, tm);
        const auto times = candidate_times(p, tm, counts, loads, rows, traffic_out, traffic_in, k, lay);
        double best_time = times[0];
        bool plain_ep = false;
        const i64 busiest = *std::max_element(before.begin(), before.end());
        const double ep_time = plain_ep_time(p, tm);
        if (ep_time < best_time && (!lay.has_budget || busiest <= lay.budget)) {
            plain_ep = true;
            best_time = ep_time;
        }
        for (i64 c = 1; c < k; ++c)
            if (times[c] < best_time) {
                best = c;
                best_time = times[c];
                plain_ep = false;
            }
        if (plain_ep) return py::make_tuple(capacity, py::none(), py::none(), py::none());
    }
    // the chosen plan's slots, rows and chunks (each plan's are its own), renumbered from 0
    const i64 slot_begin = std::find(rows.owners.begin(), rows.owners.end(), best) - rows.owners.begin();
    const i64 slot_end = std::find(rows.owners.begin() + slot_begin, rows.owners.end(), best + 1) - rows.owners.begin();
    i64 row_begin = 0;
    while (rows.rows[row_begin][SLOT] < slot_begin) ++row_begin;
    i64 row_end = row_begin;
    while (row_end < i64(rows.rows.size()) && rows.rows[row_end][SLOT] < slot_end) ++row_end;
    Chunks chunks = amounts->chunks(rows, ep, slot_begin, slot_end, row_begin, row_end);
    for (auto& chunk : chunks) chunk[CHUNK_SLOT] -= slot_begin;
    std::vector<Row> chosen(rows.rows.begin() + row_begin, rows.rows.begin() + row_end);
    for (auto& row : chosen) {
        row[SLOT] -= slot_begin;
        if (row[SOURCE_ROW] >= 0) row[SOURCE_ROW] -= row_begin;
    }
    py::array_t<i64> spilled(slot_end - slot_begin);
    std::copy(rows.experts.begin() + slot_begin, rows.experts.begin() + slot_end, spilled.mutable_data());
    return py::make_tuple(capacities[best], to_fields(chosen), spilled, to_fields(chunks));
}

PYBIND11_MODULE(_spill_core, m) {
    m.doc() = "The LLEP spill planner's compiled core (megatron_llep/planning/_spill_core.cpp).";
    m.def("spill_plan", &spill_plan);
}
