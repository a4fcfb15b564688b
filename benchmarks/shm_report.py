#!/usr/bin/env python3
"""Summarises benchmarks/shm.sh's raw results: medians across rounds, ours / theirs ratios.

Usage: shm_report.py RESULTS_DIR TITLE

Reads RESULTS_DIR/raw.txt, lines of "ROUND TOOL TEST SIZE key=value ...", for example
    2 ours lat 64 p50_us=0.28 p99_us=0.39 avg_us=0.30
    2 ucx tag_bw 65536 mb_s=13000.0 msgs_s=198000
    2 ours scaling_caller 1024 poll_ns=9.1 p50_us=0.31 p99_us=0.52 avg_us=0.33 threads=3 fds=12
(for scaling_MODE lines, SIZE is the number of connections on one completion queue; setup and
setup_inflight are rbr_setup's connections one after another and in flight)
and writes into RESULTS_DIR:
    table.txt    the table (also printed on stdout)
    results.csv  one row per comparison: medians, ratio, which direction is better
    rounds.csv   every measurement of every round
    plot.dat / plot.gp  what gnuplot draws into shm.png (run by shm.sh)
"""
import csv
import os
import statistics
import sys
from collections import defaultdict


def load(path):
    vals = defaultdict(list)  # (tool, test, size, key) -> [values, one per round]
    byr = defaultdict(dict)   # (tool, test, size, key) -> {round: value}
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) < 5:
                continue
            rnd, tool, test, size = parts[0], parts[1], parts[2], int(parts[3])
            for kv in parts[4:]:
                if "=" not in kv:
                    continue
                k, v = kv.split("=", 1)
                try:
                    x = float(v)
                except ValueError:
                    continue
                vals[(tool, test, size, k)].append(x)
                byr[(tool, test, size, k)][rnd] = x
                rows.append((rnd, tool, test, size, k, x))
    return vals, byr, rows


def human(size):
    if size >= 1 << 20 and size % (1 << 20) == 0:
        return "%d MiB" % (size >> 20)
    if size >= 1024 and size % 1024 == 0:
        return "%d KiB" % (size >> 10)
    return "%d B" % size


def main():
    out, title = sys.argv[1], sys.argv[2]
    vals, byr, rows = load(os.path.join(out, "raw.txt"))

    def med(tool, test, size, key):
        v = vals.get((tool, test, size, key))
        return (statistics.median(v), len(v)) if v else (None, 0)

    def sizes(tool, test):
        return sorted({k[2] for k in vals if k[0] == tool and k[1] == test})

    # (what, size, ours_label, ours, theirs_label, theirs, unit, lower_better, n_ours, n_theirs,
    #  ratio, ratio_rounds, size_label)
    comps = []

    def add(what, size, okey, ours_tool, ours_test, tkey, tool, test, tlabel, unit, lower,
            oscale=1.0, tscale=1.0, tsize=None, olabel=None, slabel=None):
        tsz = size if tsize is None else tsize
        o, no = med(ours_tool, ours_test, size, okey)
        t, nt = med(tool, test, tsz, tkey)
        if o is None and t is None:
            return
        # The ratio pairs the two measurements of each round (they ran minutes apart at most,
        # under the same load), then takes the median over rounds.
        ob, tb = byr.get((ours_tool, ours_test, size, okey), {}), byr.get((tool, test, tsz, tkey), {})
        pairs = [ob[r] * oscale / (tb[r] * tscale) for r in ob if r in tb and tb[r] > 0]
        comps.append((what, size, olabel or ("ours " + okey.split("_")[0] if what == "lat"
                                             else "ours " + what),
                      None if o is None else o * oscale, tlabel,
                      None if t is None else t * tscale, unit, lower, no, nt,
                      statistics.median(pairs) if pairs else None, len(pairs),
                      slabel or human(size)))

    for s in sizes("ours", "lat"):
        add("lat", s, "p50_us", "ours", "lat", "p50_us", "ucx", "tag_lat",
            "ucx tag_lat p50", "us", True)
        add("lat", s, "avg_us", "ours", "lat", "avg_us", "fi", "pingpong",
            "fi_pingpong avg", "us", True)
    # Both sides sleeping between messages: our event loop on rbr_cq_fd, and the same through
    # the tokio feature, each against UCX's event mode and against rbr_cq_poll_wait with
    # spin_us 0 (a wait that sleeps at once); and the tokio one against the event loop (what
    # the async layer costs).
    for test, label in (("lat_fd", "fd"), ("lat_tokio", "tokio")):
        for s in sizes("ours", test):
            for key, stat in (("p50_us", "p50"), ("avg_us", "avg")):
                olabel = "ours %s %s" % (label, stat)
                add("evlat", s, key, "ours", test, key, "ucx", "tag_lat_sleep",
                    "ucx -E sleep " + stat, "us", True, olabel=olabel)
                add("evlat", s, key, "ours", test, key, "ours", "lat_wait0",
                    "poll_wait spin 0 " + stat, "us", True, olabel=olabel)
                if test == "lat_tokio":
                    add("evlat", s, key, "ours", test, key, "ours", "lat_fd",
                        "ours fd " + stat, "us", True, olabel=olabel)
    for s in sizes("ours", "bw"):
        add("bw", s, "mb_s", "ours", "bw", "mb_s", "ucx", "tag_bw", "ucx tag_bw", "MB/s", False)
        if ("ucx", "ucp_put_bw", s, "mb_s") in vals:
            add("bw", s, "mb_s", "ours", "bw", "mb_s", "ucx", "ucp_put_bw", "ucx ucp_put_bw",
                "MB/s", False)
    for s in sizes("ours", "rate"):
        add("rate", s, "msgs_s", "ours", "rate", "msgs_s", "ucx", "tag_mr", "ucx tag_bw",
            "msg/s", False)
    # One-sided writes: the write ping-pong against ucp_put_lat, streaming writes against
    # ucp_put_bw and, at 1 MiB, against one memcpy (the target: 0.8x).
    for s in sizes("ours", "wlat"):
        add("wlat", s, "p50_us", "ours", "wlat", "p50_us", "ucx", "ucp_put_lat",
            "ucx ucp_put_lat p50", "us", True, olabel="ours write p50")
    for s in sizes("ours", "wbw"):
        add("wbw", s, "mb_s", "ours", "wbw", "mb_s", "ucx", "ucp_put_bw", "ucx ucp_put_bw",
            "MB/s", False, olabel="ours write bw")
        if s == 1 << 20:
            add("limit", s, "mb_s", "ours", "wbw", "gb_s", "limits", "memcpy",
                "memcpy 1 MiB", "MB/s", False, tscale=1000.0, olabel="ours write bw")
    # Against the machine's limits: one-way latency floor = half a cache-line round trip;
    # copying bandwidth = one memcpy (shm moves every byte at least once).
    lat_small = sizes("ours", "lat")
    if lat_small:
        s = lat_small[0]
        add("limit", s, "p50_us", "ours", "lat", "ns", "limits", "line_rtt",
            "half cache-line RTT", "us", True, tscale=0.5e-3, tsize=64, olabel="ours lat p50")
    for s in (1 << 20,):
        if ("ours", "bw", s, "mb_s") in vals:
            for ms in (1 << 20, 64 << 20):
                add("limit", s, "mb_s", "ours", "bw", "gb_s", "limits", "memcpy",
                    "memcpy %s" % human(ms), "MB/s", False, tscale=1000.0, tsize=ms,
                    olabel="ours bw")

    # Scaling: each connection count against one connection, measured in the same round by
    # the same run of rbr_scaling (the target: an empty poll with 1,024 idle connections costs at
    # most 2x what it costs with one).
    for mode in ("caller", "thread"):
        test = "scaling_" + mode
        counts = sizes("ours", test)
        if not counts or counts[0] != 1:
            continue
        for n in counts[1:]:
            add("poll", n, "poll_ns", "ours", test, "poll_ns", "ours", test,
                "same, 1 conn", "ns", True, tsize=1, olabel="empty poll " + mode,
                slabel="%d conns" % n)
        for n in counts[1:]:
            add("lat", n, "p50_us", "ours", test, "p50_us", "ours", test,
                "same, 1 conn", "us", True, tsize=1, olabel="64 B p50 " + mode,
                slabel="%d conns" % n)

    rounds = sorted({r[0] for r in rows}, key=int)
    lines = ["%s" % title,
             "values: medians of %d round(s); ratio: median over rounds of ours / theirs measured "
             "side by side in the same round" % len(rounds), ""]
    hdr = "%-5s %10s  %-18s %12s  %-20s %12s  %-6s %7s  %s" % (
        "test", "size", "ours", "value", "theirs", "value", "unit", "ratio", "better")
    lines += [hdr, "-" * len(hdr)]

    def fmt(x):
        if x is None:
            return "n/a"
        if x >= 1000:
            return "%.0f" % x
        if x >= 10:
            return "%.1f" % x
        return "%.3f" % x

    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["test", "size", "ours", "ours_median", "ours_rounds", "theirs",
                     "theirs_median", "theirs_rounds", "unit", "ratio_ours_over_theirs",
                     "ratio_rounds", "better", "ours_is_better"])
        for (what, size, ol, o, tl, t, unit, lower, no, nt, ratio, nr, sl) in comps:
            better = "lower" if lower else "higher"
            # (Scaling rows compare ours with ours: no side to be better.)
            ours_better = "" if ratio is None or tl == "same, 1 conn" else (
                "yes" if (ratio < 1) == lower else "no")
            w.writerow([what, size, ol, "" if o is None else "%.6g" % o, no, tl,
                        "" if t is None else "%.6g" % t, nt, unit,
                        "" if ratio is None else "%.4f" % ratio, nr, better, ours_better])
            lines.append("%-5s %10s  %-18s %12s  %-20s %12s  %-6s %7s  %s" % (
                what, sl, ol, fmt(o), tl, fmt(t), unit,
                "n/a" if ratio is None else "%.2f" % ratio,
                "%s is better%s" % (better, "" if ratio is None or what == "limit" else
                                    ", even at this precision" if abs(ratio - 1) < 0.005 else
                                    "" if tl == "same, 1 conn" else
                                    (", ours ahead" if ours_better == "yes" else
                                     ", theirs ahead"))))
    p99 = [(s, med("ours", "lat", s, "p99_us")[0]) for s in sizes("ours", "lat")]
    if p99:
        lines += ["", "ours lat p99 (us): " + ", ".join("%s %s" % (human(s), fmt(v))
                                                      for s, v in p99)]
    lines.append("limits (median): " + ", ".join(
        "%s %s" % (lbl, fmt(med("limits", test, s, k)[0]))
        for lbl, test, s, k in (("memcpy 1 MiB GB/s", "memcpy", 1 << 20, "gb_s"),
                                ("memcpy 64 MiB GB/s", "memcpy", 64 << 20, "gb_s"),
                                ("cache-line RTT ns", "line_rtt", 64, "ns"))))
    for mode in ("caller", "thread"):
        test = "scaling_" + mode
        counts = sizes("ours", test)
        if counts:
            lines.append("scaling, %s progress (client process; N = connections on one queue): " %
                         mode + "; ".join(
                             "N=%d: empty poll %s ns, 64 B p50 %s us p99 %s us, %s threads, %s fds"
                             % (n, fmt(med("ours", test, n, "poll_ns")[0]),
                                fmt(med("ours", test, n, "p50_us")[0]),
                                fmt(med("ours", test, n, "p99_us")[0]),
                                "%.0f" % (med("ours", test, n, "threads")[0] or 0),
                                "%.0f" % (med("ours", test, n, "fds")[0] or 0)) for n in counts))
            if 1 in counts and 1024 in counts:
                r = [c[10] for c in comps
                     if c[0] == "poll" and c[1] == 1024 and c[2].endswith(mode)]
                if r and r[0] is not None:
                    lines.append("  empty poll with 1024 connections / with 1: %.2fx (target "
                                 "at most 2x: %s)" % (r[0], "met" if r[0] <= 2 else "missed"))
    for suffix, how in (("", "16 receives per connection"),
                        ("_pool", "one shared receive queue for the server's connections")):
        rate, mem = "scaling_rate" + suffix, "scaling_mem" + suffix
        counts = sizes("ours", rate)
        if counts:
            lines.append("round-robin 512 B message rate, %s (rbr_scaling -r; N connections on "
                         "one queue, against N = 1 and against one connection side by side; "
                         "target at least 0.7x): " % how + "; ".join(
                             "N=%d: %s msgs/s, %.2fx of N=1, %.2fx side by side" % (
                                 n, fmt(med("ours", rate, n, "msgs_per_s")[0]),
                                 med("ours", rate, n, "ratio")[0] or 0,
                                 med("ours", rate, n, "side_ratio")[0] or 0) for n in counts))
        counts = sizes("ours", mem)
        if counts:
            lines.append("  resident memory after it (VmRSS, shared memory touched included; "
                         "per connection: the growth since the first N; target at most 64 "
                         "KiB): " + "; ".join("N=%d: client %s KiB, server %s KiB%s" % (
                             n, fmt(med("ours", mem, n, "client_kib")[0]),
                             fmt(med("ours", mem, n, "server_kib")[0]),
                             "" if med("ours", mem, n, "client_kib_per_conn")[0] is None
                             else ", per connection %s / %s KiB" % (
                                 fmt(med("ours", mem, n, "client_kib_per_conn")[0]),
                                 fmt(med("ours", mem, n, "server_kib_per_conn")[0])))
                             for n in counts))
    counts = sizes("ucx", "scaling_rate")
    if counts:
        lines.append("UCX, the same round-robin run over N endpoints of one client to one server "
                     "worker (benchmarks/ucx_scaling.c): " + "; ".join(
                         "N=%d: %s msgs/s, %.2fx side by side" % (
                             n, fmt(med("ucx", "scaling_rate", n, "msgs_per_s")[0]),
                             med("ucx", "scaling_rate", n, "side_ratio")[0] or 0)
                         for n in counts))
    counts = sizes("ucx", "scaling_mem")
    if counts:
        def um(n, key):
            return fmt(med("ucx", "scaling_mem", n, key)[0])
        lines.append("  UCX's memory after it (the server makes no endpoints; resident memory "
                     "counts the server's segments once per endpoint that maps them, the "
                     "proportional set size once): " +
                     "; ".join("N=%d: client %s KiB resident, %s KiB proportional; server %s / "
                               "%s KiB%s" % (
                                   n, um(n, "client_kib"), um(n, "client_pss_kib"),
                                   um(n, "server_kib"), um(n, "server_pss_kib"),
                                   "" if med("ucx", "scaling_mem", n,
                                             "client_kib_per_conn")[0] is None
                                   else ", per endpoint: client %s / %s KiB, server %s / %s KiB"
                                   % (um(n, "client_kib_per_conn"),
                                      um(n, "client_pss_kib_per_conn"),
                                      um(n, "server_kib_per_conn"),
                                      um(n, "server_pss_kib_per_conn")))
                               for n in counts))
    for s in sizes("ours", "setup"):
        lines.append("connection setup (rbr_setup: one after another, each connected, accepted, "
                     "given a %s message each way and closed; no stock tool measures this over "
                     "shared memory): %s conn/s; to the first answer p50 %s us, p99 %s us; to "
                     "the close's last record p50 %s us" % (
                         human(s), fmt(med("ours", "setup", s, "rate_per_s")[0]),
                         fmt(med("ours", "setup", s, "first_p50_us")[0]),
                         fmt(med("ours", "setup", s, "first_p99_us")[0]),
                         fmt(med("ours", "setup", s, "cycle_p50_us")[0])))
    for s in sizes("ours", "setup_inflight"):
        rate = med("ours", "setup_inflight", s, "rate_per_s")[0]
        # Against the one-after-another run of the same round.
        ib = byr.get(("ours", "setup_inflight", s, "rate_per_s"), {})
        tb = byr.get(("ours", "setup", s, "rate_per_s"), {})
        pairs = [ib[r] / tb[r] for r in ib if r in tb and tb[r] > 0]
        lines.append("connection setup in flight (rbr_setup -c %s: that many connections at once "
                     "from one client thread with rbr_connect_start, the server accepting "
                     "without blocking, each given a %s message each way and closed): %s conn/s "
                     "(target 20,000: %s), %s the rate one after another; to the first answer "
                     "p50 %s us, p99 %s us" % (
                         "%.0f" % (med("ours", "setup_inflight", s, "inflight")[0] or 0),
                         human(s), fmt(rate), "n/a" if rate is None else
                         "met" if rate >= 20000 else "missed",
                         "%.2fx" % statistics.median(pairs) if pairs else "n/a x",
                         fmt(med("ours", "setup_inflight", s, "first_p50_us")[0]),
                         fmt(med("ours", "setup_inflight", s, "first_p99_us")[0])))
    for mode, how, rtt_bound, late_bound in (("busy", "both busy-polling", 1000, 10),
                                             ("wait", "both in rbr_cq_poll_wait", 200, 50)):
        for s in sizes("ours", "first_" + mode):
            first = lambda k: med("ours", "first_" + mode, s, k)[0]
            late = lambda k: med("ours", "late_" + mode, s, k)[0]
            lines.append(
                "first messages, %s (rbr_first, %s connections one after another, %s): the "
                "slowest of the first 200 round trips %s us (each connection's slowest: median "
                "%s us; over %s us: %s); a message sent with no receive posted, from the "
                "receive's post 50 ms later to its completion p50 %s us, max %s us (target "
                "%s us), its send's completion p50 %s us" % (
                    human(s), "%.0f" % (first("runs") or 0), how, fmt(first("worst_us")),
                    fmt(first("worst_p50_us")), rtt_bound, "%.0f" % (first("over_us") or 0),
                    fmt(late("p50_us")), fmt(late("max_us")), late_bound,
                    fmt(late("send_p50_us"))))
    missing = [(c[4], c[12]) for c in comps if c[5] is None]
    if missing:
        lines.append("no result (the tool failed every round; see logs/): " +
                     ", ".join("%s at %s" % (m[0], m[1]) for m in missing))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(text)
    sys.stdout.write(text)

    with open(os.path.join(out, "rounds.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "tool", "test", "size", "metric", "value"])
        for r in rows:
            w.writerow(r)

    # Plot data: one block per series, "size value".
    series = [
        ("lat", "ours p50", "ours", "lat", "p50_us"),
        ("lat", "ours avg", "ours", "lat", "avg_us"),
        ("lat", "ucx tag\\_lat p50", "ucx", "tag_lat", "p50_us"),
        ("lat", "fi\\_pingpong avg", "fi", "pingpong", "avg_us"),
        ("bw", "ours bw", "ours", "bw", "mb_s"),
        ("bw", "ucx tag\\_bw", "ucx", "tag_bw", "mb_s"),
        ("bw", "ucx ucp\\_put\\_bw", "ucx", "ucp_put_bw", "mb_s"),
    ]
    blocks = []
    with open(os.path.join(out, "plot.dat"), "w") as f:
        for panel, label, tool, test, key in series:
            want = sizes(tool, test)
            if panel == "bw" and tool != "ours" and sizes("ours", "bw"):
                # tag_bw also ran at the rate sizes: plot only the bandwidth sizes.
                want = [s for s in want if s >= sizes("ours", "bw")[0]]
            pts = [(s, med(tool, test, s, key)[0]) for s in want]
            pts = [(s, v) for s, v in pts if v is not None and v > 0]
            if not pts:
                continue
            f.write("# %s\n" % label)
            for s, v in pts:
                f.write("%d %g\n" % (s, v))
            f.write("\n\n")
            blocks.append((panel, label, len(blocks)))
    mem1 = med("limits", "memcpy", 1 << 20, "gb_s")[0]
    mem64 = med("limits", "memcpy", 64 << 20, "gb_s")[0]
    styles = ["lc rgb '#d62728' pt 7", "lc rgb '#ff9896' pt 6 dt 2",
              "lc rgb '#1f77b4' pt 5", "lc rgb '#2ca02c' pt 9", "lc rgb '#d62728' pt 7",
              "lc rgb '#1f77b4' pt 5", "lc rgb '#9467bd' pt 13"]
    gp = [
        "set terminal pngcairo size 1400,560 font 'DejaVu Sans,11'",
        "set output '%s'" % os.path.join(out, "shm.png").replace("'", ""),
        "set multiplot layout 1,2 title '%s (medians of %d round(s))'" % (
            title.replace("'", ""), len(rounds)),
        "set logscale x 2", "set grid", "set key top left",
        # Tics at the sizes measured, named in binary units.
        "set xtics (%s)" % ", ".join('"%s" %d' % (human(s), s) for s in sorted(
            {k[2] for k in vals if k[0] in ("ours", "ucx", "fi")
             and not k[1].startswith("scaling_")})),
        "set xlabel 'message size'",
        "set logscale y 10", "set ylabel 'one-way latency (us), lower is better'",
        "set title 'latency'",
    ]

    def plot_cmd(panel, extra):
        parts = ["'%s' index %d using 1:2 with linespoints %s lw 2 title '%s'" % (
            os.path.join(out, "plot.dat"), idx, styles[i % len(styles)], label)
                 for i, (p, label, idx) in enumerate(blocks) if p == panel]
        parts += extra
        return "plot " + ", \\\n     ".join(parts) if parts else "plot 1 notitle"

    gp.append(plot_cmd("lat", []))
    gp += ["set ylabel 'bandwidth (MB/s = 10^6 B/s), higher is better'",
           "set title 'streaming bandwidth'", "unset logscale y", "set yrange [0:*]"]
    extra = []
    if mem1:
        extra.append("%g with lines lc rgb 'gray' dt 3 lw 2 title 'memcpy 1 MiB'" % (mem1 * 1000))
    if mem64:
        extra.append("%g with lines lc rgb 'black' dt 3 lw 2 title 'memcpy 64 MiB'" % (mem64 * 1000))
    gp.append(plot_cmd("bw", extra))
    gp.append("unset multiplot")
    with open(os.path.join(out, "plot.gp"), "w") as f:
        f.write("\n".join(gp) + "\n")


if __name__ == "__main__":
    main()
