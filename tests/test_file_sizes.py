"""Every Python file of the project, tests and benchmarks included, stays under 300 lines: a file is
one concept, small enough to read in one sitting (split by concept, not in arbitrary halves)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("server", "memory_core", "adapters", "tests", "benchmarks")
MOST_LINES = 300


def long_files(root: Path = REPO, most: int = MOST_LINES) -> dict[str, int]:
    """Project-relative path -> line count, for every ``.py`` file above ``most`` lines."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > most:
                found[str(path.relative_to(root))] = lines
    return found


def test_every_file_is_at_most_300_lines() -> None:
    assert long_files() == {}


def test_long_files_are_found(tmp_path: Path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "short.py").write_text("x = 1\n" * 300)
    (tmp_path / "server" / "long.py").write_text("x = 1\n" * 301)
    assert long_files(tmp_path) == {"server/long.py": 301}
