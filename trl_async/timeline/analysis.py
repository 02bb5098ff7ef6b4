"""Figures from a trace: where each process's time went, how much the trainer and its generator overlapped, what
the idle time was spent waiting on, how long the generation process took to start, and the limit a synchronous run
allows.

Every figure is over the **recorded wall time** of a process: the union of its kept steps (the `step` track, see
`SamplingPolicy`), start-up included, so a sampled 10,000-step run is measured on the steps it kept. Within it:

* busy = the union of its `busy` and `startup` spans (nested spans counted once);
* each wait cause = the union of the spans of that name (`wait` category) outside busy time;
* untracked = recorded time covered by no span at all (what no span names: data loading, logging, Python);
* overlap of a rank = time both its trainer and its generator are busy, over the time both were recorded.
"""

from __future__ import annotations

from collections import defaultdict

from .names import FIRST_BATCH_QUEUED, GENERATION_NAMES, GENERATOR, STARTUP_MARKS, STEP, TRAINER, TRAINING_NAMES, WAIT
from .trace import STEP_TID, load_trace

# ------------------------------------------------------------------------------------------------------ intervals
# Sorted, disjoint lists of (start, end) in seconds.


def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def length(intervals) -> float:
    return sum(e - s for s, e in intervals)


# ------------------------------------------------------------------------------------------------------ processes
def processes(path_or_trace) -> list[dict]:
    """Per process: `pid`, `role`, `rank`, `label`, `cores`, `spans` [(name, cat, start_s, end_s, cpu_s|None)],
    `steps` [(step, start_s, end_s, cpu_s)], `instants` {name: s}; ordered as the trace sorts its rows."""
    trace = load_trace(path_or_trace)
    described = {p["pid"]: p for p in trace.get("otherData", {}).get("trl_async_timeline", {}).get("processes", [])}
    names, order, found = {}, {}, defaultdict(lambda: {"spans": [], "steps": [], "instants": {}})
    for event in trace["traceEvents"]:
        pid, ph = event.get("pid"), event.get("ph")
        if ph == "M" and event["name"] == "process_name":
            names[pid] = event["args"]["name"]
        elif ph == "M" and event["name"] == "process_sort_index":
            order[pid] = event["args"]["sort_index"]
        elif ph == "X":
            start, end = event["ts"] / 1e6, (event["ts"] + event.get("dur", 0.0)) / 1e6
            cpu = event.get("args", {}).get("cpu_ms")
            cpu = None if cpu is None else cpu / 1e3
            if event.get("cat") == STEP and event.get("tid") == STEP_TID:
                found[pid]["steps"].append((event.get("args", {}).get("step"), start, end, cpu or 0.0))
            else:
                found[pid]["spans"].append((event["name"], event.get("cat", ""), start, end, cpu))
        elif ph in ("i", "I"):
            found[pid]["instants"].setdefault(event["name"], event["ts"] / 1e6)
    result = []
    for pid in sorted(found, key=lambda p: (order.get(p, p), p)):
        info = described.get(pid, {})
        label = info.get("label") or names.get(pid, f"pid {pid}")
        role = info.get("role") or (label.split()[0] if label.split() else "?")
        rank = info.get("rank", _rank_from_label(label))
        result.append({"pid": pid, "role": role, "rank": rank, "label": label, "cores": info.get("cores"),
                       "truncated": bool(info.get("truncated")), "peak_rss_bytes": info.get("peak_rss_bytes"),
                       **found[pid]})  # fmt: skip
    return result


def _rank_from_label(label: str) -> int:
    """The rank in "trainer rank 3" (a trace without `otherData`), else 0."""
    words = label.split()
    for word, following in zip(words, words[1:], strict=False):
        if word == "rank" and following.isdigit():
            return int(following)
    return 0


def recorded_time(process: dict) -> list[tuple[float, float]]:
    """The process's recorded wall time: its kept steps, or (a trace without them) its first to last event."""
    if process["steps"]:
        return union((s, e) for _, s, e, _ in process["steps"])
    times = [t for span in process["spans"] for t in span[2:4]] + list(process["instants"].values())
    return [(min(times), max(times))] if times else []


def busy_time(process: dict) -> list[tuple[float, float]]:
    spans = union((s, e) for _, cat, s, e, _ in process["spans"] if cat != WAIT)
    return intersect(spans, recorded_time(process))


def _breakdown(process: dict) -> dict:
    recorded = recorded_time(process)
    busy = busy_time(process)
    waits: dict[str, list] = defaultdict(list)
    for name, cat, start, end, _ in process["spans"]:
        if cat == WAIT:
            waits[name].append((start, end))
    wait_s = {name: length(subtract(intersect(union(v), recorded), busy)) for name, v in waits.items()}
    covered = union((s, e) for _, _, s, e, _ in process["spans"])
    wall = length(recorded)
    cpu = sum(c for *_, c in process["steps"])
    cores = process.get("cores")
    return {
        "label": process["label"], "role": process["role"], "rank": process["rank"], "recorded_s": wall,
        "steps_recorded": sum(1 for step, *_ in process["steps"] if step is not None),
        "busy_s": length(busy), "busy_fraction": length(busy) / wall if wall else 0.0,
        "wait_s": dict(sorted(wait_s.items(), key=lambda kv: -kv[1])),
        "untracked_s": length(subtract(recorded, covered)),
        "cpu_cores_busy_fraction": cpu / (wall * cores) if wall and cores and process["steps"] else None,
        "peak_rss_bytes": process.get("peak_rss_bytes"),
        "truncated": process["truncated"],
    }  # fmt: skip


def startup(process: dict) -> dict | None:
    """A generation process's start-up marks: `total_s` from the first mark (spawn) to the first batch queued, and
    the time between consecutive marks (`phases`); None without marks."""
    marks = sorted((t, name) for name, t in process["instants"].items() if name in STARTUP_MARKS)
    if not marks:
        return None
    phases = [{"from": a, "to": b, "seconds": tb - ta} for (ta, a), (tb, b) in zip(marks, marks[1:], strict=False)]
    end = process["instants"].get(FIRST_BATCH_QUEUED)
    return {"total_s": None if end is None else end - marks[0][0], "phases": phases}


def summarize(path_or_trace, top: int = 10) -> dict:
    """All figures of a trace (a run's folder, a timeline.json or a loaded dict):

    `processes`: per process label, `recorded_s`, `busy_s`, `busy_fraction`, `wait_s` {cause: s}, `untracked_s`,
    `steps_recorded`, `cpu_cores_busy_fraction` (CPU time / (recorded wall x the process's cores)),
    `peak_rss_bytes` (its peak resident memory, where recorded), `truncated`
    (its recording hit `SamplingPolicy.max_events` and stopped);
    `overlap`: per rank, `both_busy_s`, `wall_s` (recorded by both), `fraction`;
    `idle_causes`: the `top` (process, cause, seconds, fraction of its recorded time), causes being the wait spans'
    names and "untracked", largest first; `startup`: per rank (`startup`); `sync`: `sync_limit` for a synchronous
    run's trace, else None."""
    procs = processes(path_or_trace)
    summary = {"processes": {}, "overlap": {}, "idle_causes": [], "startup": {}, "sync": None}
    for process in procs:
        figures = _breakdown(process)
        summary["processes"][process["label"]] = figures
        causes = [*figures["wait_s"].items(), ("untracked", figures["untracked_s"])]
        summary["idle_causes"] += [
            {"process": process["label"], "cause": cause, "seconds": seconds,
             "fraction": seconds / figures["recorded_s"] if figures["recorded_s"] else 0.0}
            for cause, seconds in causes if seconds > 0
        ]  # fmt: skip
    summary["idle_causes"] = sorted(summary["idle_causes"], key=lambda c: -c["seconds"])[:top]
    by_rank: dict[int, dict[str, dict]] = defaultdict(dict)
    for process in procs:
        by_rank[process["rank"]][process["role"]] = process
    for rank, roles in sorted(by_rank.items()):
        if TRAINER in roles and GENERATOR in roles:
            trainer, generator = roles[TRAINER], roles[GENERATOR]
            both = intersect(recorded_time(trainer), recorded_time(generator))
            overlap = length(intersect(busy_time(trainer), busy_time(generator)))  # each within its own recording
            summary["overlap"][rank] = {"both_busy_s": overlap, "wall_s": length(both),
                                        "fraction": overlap / length(both) if length(both) else 0.0}  # fmt: skip
        if GENERATOR in roles and (figures := startup(roles[GENERATOR])) is not None:
            summary["startup"][rank] = figures
    if procs and not any(p["role"] == GENERATOR for p in procs):
        trainers = [p for p in procs if p["role"] == TRAINER]
        if trainers and any(name in GENERATION_NAMES for name, *_ in trainers[0]["spans"]):
            try:
                summary["sync"] = sync_limit(trainers[0])
            except ValueError:  # generation spans but no training ones: nothing to overlap
                pass
    return summary


# ------------------------------------------------------------------------------------------------------ the limit
def sync_limit(path_or_process, rank: int = 0) -> dict:
    """What overlapping generation with training could give, from a synchronous run (one process doing both in turn).

    Over the trainer's recorded steps: G = time in generation spans (`names.GENERATION_NAMES`), T = time in training
    spans (`names.TRAINING_NAMES`) outside generation spans, W = the steps' wall time. `ideal_overlap_ratio` =
    (G + T) / max(G, T): the speed-up if the two ran fully in parallel; `amdahl_ratio` = W / (W - min(G, T)): the
    same with the rest of the step (logging, data) staying serial. Where the spans carry CPU time (`end_cpu`) and the
    trace knows the cores: `generation_cores`, `training_cores` (mean cores busy in each), `cpu_bound_ratio` =
    (G + T) / max(G, T, (cpu_G + cpu_T) / cores), the ideal speed-up when both must share the cores, and
    `core_busy_fraction`, CPU time over W x cores for the whole run."""
    process = path_or_process
    if not isinstance(process, dict) or "spans" not in process:
        process = next(p for p in processes(path_or_process) if p["role"] == TRAINER and p["rank"] == rank)
    window = union((s, e) for step, s, e, _ in process["steps"] if step is not None) or recorded_time(process)
    generation_spans = [sp for sp in process["spans"] if sp[0] in GENERATION_NAMES]
    training_spans = [sp for sp in process["spans"] if sp[0] in TRAINING_NAMES]
    generation = intersect(union((s, e) for *_, s, e, _ in generation_spans), window)
    training = subtract(intersect(union((s, e) for *_, s, e, _ in training_spans), window), generation)
    g, t, w = length(generation), length(training), length(window)
    if g == 0 or t == 0:
        raise ValueError("the trace has no generation or no training spans in its recorded steps: not a sync run")
    limit = {"generation_s": g, "training_s": t, "wall_s": w, "ideal_overlap_ratio": (g + t) / max(g, t),
             "amdahl_ratio": w / (w - min(g, t)) if w > min(g, t) else None}  # fmt: skip
    cores = process.get("cores")
    cpu_g = [sp[4] for sp in generation_spans if sp[4] is not None]
    cpu_t = [sp[4] for sp in training_spans if sp[4] is not None]
    if cores and cpu_g and cpu_t:
        cpu_g_s, cpu_t_s = sum(cpu_g), sum(cpu_t)
        limit["generation_cores"] = cpu_g_s / sum(e - s for n, c, s, e, cpu in generation_spans if cpu is not None)
        limit["training_cores"] = cpu_t_s / sum(e - s for n, c, s, e, cpu in training_spans if cpu is not None)
        limit["cpu_bound_ratio"] = (g + t) / max(g, t, (cpu_g_s + cpu_t_s) / cores)
    steps = [st for st in process["steps"] if st[0] is not None]
    if cores and steps:
        limit["core_busy_fraction"] = sum(c for *_, c in steps) / (w * cores)
    return limit


def ideal_overlap_ratio(path_or_trace, rank: int = 0) -> float:
    """(generation + training) / max(generation, training) of a synchronous run's trainer (`sync_limit`)."""
    return sync_limit(path_or_trace, rank)["ideal_overlap_ratio"]
