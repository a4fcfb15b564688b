#!/usr/bin/env python3
"""Turns benchmarks/verbs-progress.sh's raw figures into a CSV and a gnuplot script.

Usage: verbs_report.py RESULTS_DIR

Reads RESULTS_DIR/raw.txt, lines of "RESULT MEASURE TOOL FIELD VALUE" written in the VM, e.g.
    RESULT lat2 ib_send_lat p50 21.3
    RESULT wbw65536 rbr-rma mbs 412.0
(MEASURE: lat, bw = send/receive; elat = send/receive with both sides asleep between
messages; wlat, rlat, wbw, rbw = RDMA write and read; rkern, ruser =
a read's round trip inside and outside the client's write() to the device; then the size;
conn = connection setup one after another, inflight = connections in flight, the count after
it, both against cmtime with the same count; late, first = rbr_first's message that waits for
its receive and its slowest first round trips). Writes into RESULTS_DIR:
    results.csv  per measure, tool and field: median, min, max over rounds, the ratio of
                 the median to the stock tool's median for the same measure and field, and
                 the median over rounds of each round's ratio (ours and the stock tool ran
                 minutes apart at most within a round, under the same load)
    plot.dat / plot.gp  what gnuplot draws into verbs.png (run by verbs-progress.sh)
"""
import csv
import os
import re
import statistics
import sys
from collections import defaultdict

STOCK = {
    "lat": "ib_send_lat", "elat": "ib_send_lat-e", "bw": "ib_send_bw", "wlat": "ib_write_lat", "rlat": "ib_read_lat",
    "wbw": "ib_write_bw", "rbw": "ib_read_bw", "conn": "cmtime", "inflight": "cmtime",
    "rkern": "ib_read_lat", "ruser": "ib_read_lat",
    # A message that waits for its receive, against the one-way latency of a message that
    # does not; the slowest of the first round trips against a steady round trip.
    "late": "ib_send_lat", "first": "rbr-steady", "firstone": "rbr-steady",
    # The stock tool's first round trip against its own steady one.
    "firststock": "ib_send_lat-steady",
    # The round-robin rate over N connections against one connection's, side by side.
    "rr": "rbr-one-conn", "rrq": "rbr-one-conn",
}


def main():
    out = sys.argv[1]
    vals = defaultdict(list)  # (kind, size, tool, field) -> values
    with open(os.path.join(out, "raw.txt")) as f:
        for line in f:
            p = line.split()
            if len(p) != 5 or p[0] != "RESULT":
                continue
            m = re.fullmatch(r"([a-z]+?)(\d*)", p[1])
            try:
                v = float(p[4])
            except ValueError:
                continue
            kind, size = m.group(1), int(m.group(2) or 0)
            vals[(kind, size, p[2], p[3])].append(v)
    med = {k: statistics.median(v) for k, v in vals.items()}
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["measure", "size_bytes", "tool", "field", "median", "min", "max", "rounds",
                    "ratio_to_stock", "ratio_by_round_median", "stock_tool", "better"])
        for k in sorted(vals):
            kind, size, tool, field = k
            stock = STOCK.get(kind)
            ref = med.get((kind, size, stock, field))
            ratio = "" if not ref else "%.3f" % (med[k] / ref)
            # Every tool gives one figure per round, in round order (the guest checks the
            # count), so the i-th figures of two tools are of the same round.
            refs = vals.get((kind, size, stock, field), [])
            pairs = [a / b for a, b in zip(vals[k], refs) if b > 0]
            by_round = ("%.3f" % statistics.median(pairs)
                        if pairs and len(refs) == len(vals[k]) else "")
            better = "lower" if field in ("p50", "p99", "kib") else "higher"
            w.writerow([kind, size, tool, field, "%g" % med[k], "%g" % min(vals[k]),
                        "%g" % max(vals[k]), len(vals[k]), ratio, by_round, stock or "",
                        better])
    # One data block per (panel, tool): latency p50 and bandwidth against size.
    blocks = []
    for panel, kinds, field in (("lat", ("lat", "wlat", "rlat"), "p50"),
                                ("bw", ("bw", "wbw", "rbw"), "mbs")):
        for kind in kinds:
            tools = sorted({k[2] for k in vals if k[0] == kind and k[3] == field})
            for tool in tools:
                pts = sorted((k[1], med[k]) for k in vals
                             if k[0] == kind and k[2] == tool and k[3] == field)
                if pts:
                    blocks.append((panel, "%s %s" % (kind, tool), pts))
    with open(os.path.join(out, "plot.dat"), "w") as f:
        for _, title, pts in blocks:
            f.write("# %s\n" % title)
            for s, v in pts:
                f.write("%d %g\n" % (s, v))
            f.write("\n\n")
    dat = os.path.join(out, "plot.dat").replace("'", "")
    lines = [
        # noenhanced: tool names such as ib_send_lat are printed as they are, not as
        # subscripts.
        "set terminal pngcairo size 1400,640 noenhanced",
        "set output '%s'" % os.path.join(out, "verbs.png").replace("'", ""),
        "set multiplot layout 1,2 title 'rdmabridge verbs vs perftest on soft-RoCE "
        "(medians over rounds)'",
        "set logscale x 2", "set grid", "set key below font ',9' maxrows 4",
        "set format x '%.0b %BB'",
        "set xlabel 'message size'",
    ]
    for panel, ylabel in (("lat", "latency p50 (us; send/write one-way, read round trip)"),
                          ("bw", "bandwidth (MB/s)")):
        plots = ["'%s' index %d using 1:2 with linespoints title '%s'" % (dat, i, t)
                 for i, (p, t, _) in enumerate(blocks) if p == panel]
        lines.append("set ylabel '%s'" % ylabel)
        lines.append("set logscale y" if panel == "lat" else "unset logscale y")
        lines.append("plot " + ", ".join(plots) if plots else "clear")
    lines.append("unset multiplot")
    with open(os.path.join(out, "plot.gp"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("results: %s" % os.path.join(out, "results.csv"))


if __name__ == "__main__":
    main()
