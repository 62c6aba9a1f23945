"""How well the static doctor finds its pitfalls, next to TorchFix, and whether it survives real code.

Three measurements:

1. **Corpus** (``tests/doctor_corpus``): every line of a ``pos_*.py`` file that must be
   reported carries ``# expect: TT1xx``; ``neg_*.py`` files are correct code that looks
   alike. Per rule: the marked positives, how many were found (recall), findings on
   positive files that no marker asks for, and findings on negative files (false
   positives, any rule).
2. **TorchFix** (Meta's PyTorch linter, ``pip install torchfix``) on the same files, all
   its rules on (``--select ALL``). Where one of its rules covers the same pitfall as ours
   (TOR102 ``torch.load`` without ``weights_only`` = TT111, TOR401 DataLoader without
   workers = TT121, TOR001/101/004/103 removed or deprecated functions = TT118) the table
   shows how many of our positives it reports on the same line and how often it fires on
   our negatives; elsewhere it has no equivalent rule. Its findings on our negatives are
   listed so they can be judged: a TOR401 on a loader that deliberately keeps
   ``num_workers=0`` (in-memory data, evaluation only) is a false positive by our rule's
   definition, not a bug in TorchFix's.
3. **The installed torch package**: every ``.py`` file under ``torch.__path__[0]`` is
   linted; files, findings per rule, files that do not parse (reported, not fatal) and
   wall time. A crash of the linter on any file fails the run. The same lint is then timed
   side by side, in fresh processes, with the doctor of an earlier revision (``--baseline``,
   by default the doctor before issue 15): the ratio must stay at or under 1.5x.

A JSON summary ends the output (``--json PATH`` also writes it to a file).

Usage::

    pip install -e ".[dev,peers]"     # torchfix comes with [peers]
    python benchmarks/doctor_corpus.py [--skip-torch] [--no-torchfix] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from tqdm import tqdm

from torch_tricks.doctor.static import lint_paths, lint_source, static_rules

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "doctor_corpus"
_EXPECT = re.compile(r"#\s*expect:\s*(TT\d+(?:\s*,\s*TT\d+)*)")
_TORCHFIX_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): (?P<code>TOR\d+) ")
# Our rule -> the TorchFix codes that cover the same pitfall.
TORCHFIX_EQUIVALENTS = {"TT111": ("TOR102",), "TT121": ("TOR401",), "TT118": ("TOR001", "TOR101", "TOR004", "TOR103")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-torch", action="store_true", help="do not lint the installed torch package")
    parser.add_argument("--no-torchfix", action="store_true", help="do not run TorchFix")
    parser.add_argument("--json", type=Path, help="also write the JSON summary here")
    parser.add_argument("--baseline", default=BASELINE_REV, metavar="REV",
                        help="also lint the torch package with the doctor of this git revision, in a fresh "
                             "process beside the current one, and print the time ratio (default: the doctor "
                             f"before issue 15, {BASELINE_REV[:10]}; 'none' skips it)")
    args = parser.parse_args()

    files = sorted(CORPUS.glob("*/pos_*.py")) + sorted(CORPUS.glob("*/neg_*.py"))
    corpus = run_corpus(files)
    torchfix = None if args.no_torchfix else run_torchfix(files)
    print_corpus_table(corpus, torchfix)
    package = None if args.skip_torch else lint_torch_package()
    speed = None if args.skip_torch or args.baseline == "none" else compare_with_baseline(args.baseline)
    clocks = lint_clock_reads()

    summary = {"corpus": corpus["per_rule"], "corpus_totals": corpus["totals"],
               "torchfix": torchfix and {k: v for k, v in torchfix.items() if k != "findings"},
               "torch_package": package, "against_baseline": speed, "clock_reads": clocks}
    text = json.dumps(summary, indent=2, ensure_ascii=False)
    print("\nJSON summary")
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    failed = corpus["totals"]["missed"] or corpus["totals"]["false_positives"] or not clocks["pass"] or (
        speed is not None and speed.get("pass") is False)
    if package is not None:
        assert package["crashes"] == 0, f"the linter crashed on {package['crashes']} file(s)"
    return 1 if failed else 0


# --------------------------------------------------------------------------- our rules on the corpus


def markers(path: Path) -> set[tuple[str, int]]:
    out = set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for m in _EXPECT.finditer(line):
            out.update((code.strip(), lineno) for code in m.group(1).split(","))
    return out


def run_corpus(files: list[Path]) -> dict:
    """Per rule: positives, found, unexpected findings on positive files, findings on negatives."""
    stats = {r.id: {"name": r.name, "severity": r.severity, "positives": 0, "found": 0,
                    "unexpected_on_positives": 0, "false_positives_on_negatives": 0} for r in static_rules()}
    started = time.perf_counter()
    for path in files:
        want = markers(path)
        got = {(f.rule, f.line) for f in lint_source(path.read_text(encoding="utf-8"), str(path), select=["hygiene"])}
        negative = path.name.startswith("neg_")
        for rule, _ in want:
            stats[rule]["positives"] += 1
        for rule, _ in want & got:
            stats[rule]["found"] += 1
        for rule, _ in got - want:
            stats[rule]["false_positives_on_negatives" if negative else "unexpected_on_positives"] += 1
    for s in stats.values():
        s["recall"] = round(s["found"] / s["positives"], 3) if s["positives"] else None
    totals = {"files": len(files), "positive_files": sum(p.name.startswith("pos_") for p in files),
              "negative_files": sum(p.name.startswith("neg_") for p in files),
              "positives": sum(s["positives"] for s in stats.values()),
              "found": sum(s["found"] for s in stats.values()),
              "missed": sum(s["positives"] - s["found"] for s in stats.values()),
              "false_positives": sum(s["unexpected_on_positives"] + s["false_positives_on_negatives"]
                                     for s in stats.values()),
              "seconds": round(time.perf_counter() - started, 3)}
    return {"per_rule": stats, "totals": totals}


# --------------------------------------------------------------------------- TorchFix on the corpus


def run_torchfix(files: list[Path]) -> dict | None:
    """TorchFix's findings on the corpus files, and how they line up with our markers."""
    if importlib.util.find_spec("torchfix") is None:
        print("TorchFix is not installed (pip install torchfix): its columns are left out\n")
        return None
    version = importlib.metadata.version("torchfix")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torchfix", "--select", "ALL", *map(str, files)],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    findings = []
    for line in proc.stdout.splitlines():
        m = _TORCHFIX_LINE.match(line)
        if m:
            findings.append((str(Path(m["path"]).resolve()), int(m["line"]), m["code"]))
    if not findings and proc.returncode not in (0, 1):
        print(f"TorchFix failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}\n")
        return None
    at = defaultdict(set)
    for path, line, code in findings:
        at[(path, line)].add(code)
    negatives = {str(p.resolve()) for p in files if p.name.startswith("neg_")}
    per_rule = {}
    for rule in (r.id for r in static_rules()):
        codes = TORCHFIX_EQUIVALENTS.get(rule)
        if codes is None:
            per_rule[rule] = {"equivalent": None}
            continue
        positives = [(str(p.resolve()), line) for p in files if p.name.startswith("pos_")
                     for r, line in markers(p) if r == rule]
        found = sum(bool(at[key] & set(codes)) for key in positives)
        on_negatives = sorted((Path(p).relative_to(CORPUS).as_posix(), line, code) for p, line, code in findings
                              if p in negatives and code in codes)
        per_rule[rule] = {"equivalent": list(codes), "positives": len(positives), "found": found,
                          "flags_on_negatives": len(on_negatives), "negatives_flagged": on_negatives}
    on_negatives = Counter(code for p, _, code in findings if p in negatives)
    return {"version": version, "seconds": round(seconds, 2), "findings_total": len(findings),
            "findings_by_code": dict(Counter(code for _, _, code in findings)),
            "findings_on_negatives_by_code": dict(on_negatives), "per_rule": per_rule, "findings": findings}


def print_corpus_table(corpus: dict, torchfix: dict | None) -> None:
    t = corpus["totals"]
    print(f"Corpus: {t['files']} files ({t['positive_files']} positive, {t['negative_files']} negative), "
          f"{t['positives']} marked positives, linted in {t['seconds']:.2f}s")
    if torchfix:
        print(f"TorchFix {torchfix['version']} (--select ALL) on the same files: "
              f"{torchfix['findings_total']} findings in {torchfix['seconds']:.1f}s")
    print()
    head = f"{'rule':<6} {'name':<33} {'sev':<7} {'pos':>4} {'found':>5} {'recall':>6} {'FP+':>4} {'FP-':>4}"
    head += "  TorchFix (same pitfall: found/pos, flags on our negatives)" if torchfix else ""
    print(head)
    print("-" * len(head))
    for rule, s in corpus["per_rule"].items():
        row = (f"{rule:<6} {s['name']:<33} {s['severity']:<7} {s['positives']:>4} {s['found']:>5} "
               f"{s['recall'] if s['recall'] is not None else '-':>6} {s['unexpected_on_positives']:>4} "
               f"{s['false_positives_on_negatives']:>4}")
        if torchfix:
            tf = torchfix["per_rule"][rule]
            if tf["equivalent"] is None:
                row += "  no equivalent"
            else:
                row += (f"  {'/'.join(tf['equivalent'][:2])}{'/…' if len(tf['equivalent']) > 2 else ''}: "
                        f"{tf['found']}/{tf['positives']}, {tf['flags_on_negatives']} on negatives")
        print(row)
    print(f"\nTotal: {t['found']}/{t['positives']} found, {t['missed']} missed, "
          f"{t['false_positives']} false positives (FP+: unmarked findings on positive files; "
          f"FP-: findings on negative files)")
    if torchfix:
        flagged = [(rule, f"{p}:{line} {code}") for rule, tf in torchfix["per_rule"].items()
                   if tf["equivalent"] for p, line, code in tf["negatives_flagged"]]
        if flagged:
            print("TorchFix findings on our negative files (correct code by our rule's definition):")
            for rule, where in flagged:
                print(f"  {where}   (our {rule} stays quiet: see the comment on that line)")
        others = {c: n for c, n in torchfix["findings_on_negatives_by_code"].items()
                  if not any(c in codes for codes in TORCHFIX_EQUIVALENTS.values())}
        if others:
            print(f"TorchFix findings on negatives from rules we have no equivalent of: {others}")


# --------------------------------------------------------------------------- the torch package


def lint_torch_package() -> dict:
    """Lint every .py file of the installed torch; a crash is counted, not hidden."""
    spec = importlib.util.find_spec("torch")
    root = Path(spec.submodule_search_locations[0])
    bar = tqdm(desc="linting torch", unit="file", file=sys.stderr, mininterval=1.0)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    started = time.perf_counter()
    crashes, crash = 0, None
    try:
        result = lint_paths([root], progress=progress)
    except Exception as exc:  # the benchmark's job is to notice
        crashes, crash = 1, f"{type(exc).__name__}: {exc} {getattr(exc, '__notes__', '')}"
        result = None
    bar.close()
    seconds = time.perf_counter() - started
    import torch  # only for its version, after timing

    if result is None:
        print(f"\nThe linter CRASHED on the torch package: {crash}")
        return {"torch_version": torch.__version__, "root": str(root), "crashes": crashes, "crash": crash}
    by_rule = dict(sorted(Counter(f.rule for f in result.findings).items()))
    print(f"\ntorch {torch.__version__} package ({root}):")
    print(f"  {result.files} files, {len(result.findings)} findings, {len(result.errors)} unparseable, "
          f"{seconds:.1f}s wall ({result.files / seconds:.0f} files/s), 0 crashes")
    print(f"  findings by rule: {by_rule}")
    for path, reason in result.errors:
        print(f"  unparseable: {Path(path).relative_to(root.parent)}: {reason}")
    return {"torch_version": torch.__version__, "files": result.files, "findings": len(result.findings),
            "findings_by_rule": by_rule, "unparseable": len(result.errors),
            "unparseable_files": [[str(Path(p).relative_to(root.parent)), r] for p, r in result.errors],
            "seconds": round(seconds, 1), "crashes": crashes}


# --------------------------------------------------------------------------- against an earlier doctor

#: The doctor as issue 15 found it (the parent of its first commit): linting torch may take at most
#: SLOWDOWN_LIMIT times as long now, measured side by side in this run.
BASELINE_REV, SLOWDOWN_LIMIT = "b676ff737542a8da3ea180216f7f669a11c7a1bc", 1.5
_TIME_LINT = (
    "import json, os, sys, time, torch\n"
    "from torch_tricks.doctor.static import lint_paths\n"
    "import torch_tricks\n"
    "t = time.perf_counter()\n"
    "r = lint_paths([os.path.dirname(torch.__file__)])\n"
    "print(json.dumps({'seconds': time.perf_counter() - t, 'findings': len(r.findings), 'files': r.files,\n"
    "                  'module': torch_tricks.__file__}))\n")


def compare_with_baseline(rev: str, rounds: int = 2) -> dict:
    """Lint the torch package with the doctor of ``rev`` (its ``src/`` exported to a temporary
    folder) and with this checkout's, each in a fresh process, alternating ``rounds`` times; the
    ratio of the medians. A machine's speed changes between runs: only the side-by-side ratio counts."""
    import statistics
    import tempfile

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "src"], capture_output=True)
        if archive.returncode != 0:
            print(f"\nbaseline {rev}: not available ({archive.stderr.decode().strip()[:120]}): ratio not measured")
            return {"baseline": rev, "measured": False}
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        times: dict[str, list[float]] = {"baseline": [], "now": []}
        for _ in tqdm(range(rounds), desc="torch lint: baseline vs now", unit="round", file=sys.stderr):
            for which, src in (("baseline", Path(tmp) / "src"), ("now", root / "src")):
                env = {**os.environ, "PYTHONPATH": str(src)}
                out = subprocess.run([sys.executable, "-c", _TIME_LINT], capture_output=True, text=True, env=env,
                                     check=True)
                data = json.loads(out.stdout.strip().splitlines()[-1])
                assert Path(data["module"]).resolve().is_relative_to(src.resolve()), data["module"]
                times[which].append(data["seconds"])
    base, now = statistics.median(times["baseline"]), statistics.median(times["now"])
    ratio = now / base
    verdict = "PASS" if ratio <= SLOWDOWN_LIMIT else "FAIL"
    print(f"\nlinting torch, side by side: now {now:.1f}s, doctor @ {rev[:10]} {base:.1f}s: "
          f"{ratio:.2f}x ({verdict}: target <= {SLOWDOWN_LIMIT}x)")
    return {"baseline": rev, "measured": True, "seconds_now": round(now, 1), "seconds_baseline": round(base, 1),
            "ratio": round(ratio, 2), "pass": ratio <= SLOWDOWN_LIMIT}


# --------------------------------------------------------------------------- many clock reads in one function

CLOCK_READS, CLOCK_TARGET_S = 30_000, 10.0


def clock_function(reads: int) -> str:
    """One function timing ``reads`` CUDA forwards: what TT112 pairs clock reads in (every pair a finding)."""
    lines = ["import time", "import torch", "", "net = torch.nn.Linear(4, 4).cuda()", "", "def bench(x):",
             "    x = x.cuda()"]
    for i in range(reads):
        lines += [f"    t{i} = time.perf_counter()", "    y = net(x)"]
    return "\n".join(lines + ["    return y", ""])


def lint_clock_reads(reads: int = CLOCK_READS) -> dict:
    """Lint time of one function with ``reads`` clock reads (TT112's analysis was quadratic in them)."""
    from torch_tricks.doctor.static import lint_source

    source = clock_function(reads)
    started = time.perf_counter()
    findings = lint_source(source, "clocks.py")
    seconds = time.perf_counter() - started
    ok = seconds < CLOCK_TARGET_S
    print(f"\none function with {reads:,} clock reads: {seconds:.1f} s, {len(findings):,} findings "
          f"({'PASS' if ok else 'FAIL'}: target < {CLOCK_TARGET_S:.0f} s)")
    return {"reads": reads, "seconds": round(seconds, 2), "findings": len(findings), "pass": ok}


if __name__ == "__main__":
    sys.exit(main())
