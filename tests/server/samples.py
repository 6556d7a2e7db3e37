"""What server/demo/samples/README.md says about each sample: where it comes from, what the demo answers.

The tests hold the running demo (tests/server/test_demo_samples.py) and the page
(tests/server/test_page.py) to this table, so the README cannot drift from what the demo does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from memvit.server.demo import SAMPLES_DIR

README = SAMPLES_DIR / "README.md"
_ANSWER = re.compile(r"^(?P<label>\S+) \((?P<probability>[01]\.\d\d)\)$")
_INDEX = re.compile(r"^(?P<index>\d+)(?:, turned (?P<degrees>\d+) degrees counter-clockwise)?$")


@dataclass(frozen=True)
class SampleRow:
    file: str
    dataset: str
    index: int
    turns: int  # quarter turns counter-clockwise (np.rot90)
    answers: dict[str, tuple[str, float]]  # task -> (top-1 label, probability to 2 decimals)

    @property
    def path(self) -> Path:
        return SAMPLES_DIR / self.file


def sample_rows(readme: Path = README) -> list[SampleRow]:
    """The README's table, one row per sample file. Raises ValueError on a row it cannot read."""
    lines = [line.strip() for line in readme.read_text().splitlines() if line.strip().startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    if header[:4] != ["file", "dataset", "split", "index"]:
        raise ValueError(f"{readme}: unexpected table header {header}")
    tasks = header[4:]
    rows = []
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        index = _INDEX.match(cells[3])
        answers = [_ANSWER.match(cell) for cell in cells[4:]]
        if len(cells) != len(header) or index is None or not all(answers):
            raise ValueError(f"{readme}: cannot read the row {line!r}")
        rows.append(
            SampleRow(
                file=cells[0].strip("`"),
                dataset=cells[1],
                index=int(index["index"]),
                turns=int(index["degrees"] or 0) // 90,
                answers={
                    task: (m["label"], float(m["probability"]))
                    for task, m in zip(tasks, answers, strict=True)
                    if m is not None
                },
            )
        )
    return rows
