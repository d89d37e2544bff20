"""How a health row is judged in a CI run: THE table. A row has data and passes its threshold, has data
and fails it, or has no data; its check is enforced (`--fail-on KEY...`) or only reported. Each of the
six cases is one status, said the same way on stdout, in the JSON's `verdict`, in JUnit, in the exit
code, in docs/CI.md and in `gpuwatch stress --help` - all read this table (a test holds docs/CI.md to
it). Before it, stdout printed "pass" beside a value past its threshold (`22.6 % (> 85.0 %) pass`) and
"n/a" for a row that failed the run, which docs/CI.md called "skipped".

Pure data, no imports: `gpuwatch.ci` and the CLI's help import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["pass", "FAIL", "FAIL (not enforced)", "FAIL (no data)", "no data (not enforced)"]
Check = Literal["pass", "fail", "skipped"]  # a JUnit test case / the JSON's `checks` status


@dataclass(frozen=True)
class Judgement:
    status: Status  # stdout and the JSON's `verdict`
    check: Check  # JUnit: pass (<system-out>), fail (<failure>), skipped (<skipped>)
    fails_run: bool  # exit code 1
    means: str  # docs/CI.md and --help


# (has data and passed: True / False / None = no data, enforced by --fail-on) -> the judgement
RULES: dict[tuple[bool | None, bool], Judgement] = {
    (True, True): Judgement("pass", "pass", False, "the value meets the threshold"),
    (True, False): Judgement("pass", "pass", False, "the value meets the threshold"),
    (False, True): Judgement("FAIL", "fail", True, "the value is past a threshold given with --fail-on: the run fails"),
    (False, False): Judgement("FAIL (not enforced)", "pass", False,
                              "the value is past the report's default threshold, which --fail-on did not name: "
                              "reported, the run does not fail"),
    (None, True): Judgement("FAIL (no data)", "fail", True,
                            "the session has no data for a check named in --fail-on (no GPU, no MFU on a CPU, ...): "
                            "no data is not a pass, the run fails"),
    (None, False): Judgement("no data (not enforced)", "skipped", False,
                             "the session has no data for a check --fail-on did not name: skipped"),
}
STATUSES: tuple[Status, ...] = tuple(dict.fromkeys(j.status for j in RULES.values()))


def judge(passed: bool | None, enforced: bool) -> Judgement:
    """A health row's judgement: `passed` is the row against its threshold (None: no data)."""
    return RULES[(passed, bool(enforced))]


def by_status() -> dict[Status, Judgement]:
    """One judgement per status (the docs' and the help's table)."""
    return {j.status: j for j in RULES.values()}


def help_text() -> str:
    """The statuses in one sentence for `--help` (argparse: no bare %)."""
    return "; ".join(f"{s}: {j.means}" for s, j in by_status().items()).replace("%", "%%")


_JUNIT = {"pass": "passed (`<system-out>`)", "fail": "`<failure>`", "skipped": "`<skipped>`"}


def docs_table() -> str:
    """docs/CI.md's status table, as this table says it (a test holds the docs to it)."""
    lines = ["| status | means | JUnit | exit 1 |", "|---|---|---|---|"]
    lines += [f"| `{s}` | {j.means} | {_JUNIT[j.check]} | {'yes' if j.fails_run else 'no'} |"
              for s, j in by_status().items()]
    return "\n".join(lines)
