#!/usr/bin/env python3
"""The lowest max pod share (by requests) a placement that keeps each group
of requests on one pod can reach on a Mooncake-format trace, per pool size.

A group is the requests sharing their first K blocks (`hash_ids[:K]`):
splitting one re-prefills those blocks on every extra pod. Each group goes,
at its first request, to the pod with the fewest requests so far and stays
there (online least-count; it never learns a group's size early). Also
prints what holding every pod to 1.3x fair costs: each group split over
ceil(n / cap) pods re-prefills its members' common prefix on each extra
pod (the pooled bound reuses every block once cached, with room for all).

usage: share_floor.py TRACE [POOL ...]
"""
import collections
import json
import math
import sys


def main():
    trace = [json.loads(line) for line in open(sys.argv[1])]
    pools = [int(p) for p in sys.argv[2:]] or [64, 256, 1024]
    total = sum(len(r["hash_ids"]) for r in trace)
    unique = {h for r in trace for h in r["hash_ids"]}
    for pods in pools:
        fair = len(trace) / pods
        cap = math.floor(1.3 * fair)
        for k in (1, 8):
            home, count, members = {}, [0] * pods, {}
            sizes = collections.Counter()
            common = {}
            for request in trace:
                group = tuple(request["hash_ids"][:k])
                if group not in home:
                    home[group] = min(range(pods), key=count.__getitem__)
                count[home[group]] += 1
                sizes[group] += 1
                ids = request["hash_ids"]
                prefix = common.get(group, len(ids))
                first = members.setdefault(group, ids)
                while prefix and first[:prefix] != ids[:prefix]:
                    prefix -= 1
                common[group] = prefix
            split_blocks = sum(
                (math.ceil(n / cap) - 1) * common[g] for g, n in sizes.items()
            )
            reusable = total - len(unique)
            print(
                f"{pods} pods, groups by first {k} blocks: {len(home)} groups, "
                f"largest {max(sizes.values())}; sticky least-count max share "
                f"{max(count) / fair:.2f}x fair; holding pods to {cap} requests "
                f"(1.3x) re-prefills >= {split_blocks} blocks "
                f"(<= {100 * (1 - split_blocks / reusable):.1f} % of the pooled bound)"
            )


if __name__ == "__main__":
    main()
