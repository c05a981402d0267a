"""Sorted sets for ``DiskStore`` (``zadd``/``zrange``...): SQLite, since diskcache has none.

A table of (key, member, score) in ``index.db`` beside diskcache's database, in WAL mode like
it, so a read never waits for a writer and several processes share it safely. Each method is
one statement or one transaction. Errors are ``sqlite3`` errors; ``DiskStore`` maps them to
``StoreError``.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path


class SortedSets:
    """DiskStore's sorted sets: one SQLite table in ``index.db`` beside diskcache's database,
    in WAL mode like it (a read never waits for a writer). One connection per thread."""

    _SCHEMA = (
        "CREATE TABLE IF NOT EXISTS zset (key TEXT NOT NULL, member TEXT NOT NULL, "
        "score REAL NOT NULL, PRIMARY KEY (key, member)) WITHOUT ROWID",
        "CREATE INDEX IF NOT EXISTS zset_order ON zset (key, score, member)",
    )

    def __init__(self, path: Path) -> None:
        self._path = path
        self._local = threading.local()
        self._con()

    def _con(self) -> sqlite3.Connection:
        con: sqlite3.Connection | None = getattr(self._local, "con", None)
        if con is None:
            con = sqlite3.connect(self._path, timeout=60)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            with con:
                for statement in self._SCHEMA:
                    con.execute(statement)
            self._local.con = con
        return con

    def add(self, key: str, scores: Mapping[str, float]) -> None:
        self.add_many({key: scores})

    def add_many(self, sets: Mapping[str, Mapping[str, float]]) -> None:
        """Every key's members in one transaction."""
        with self._con() as con:
            con.executemany(
                "INSERT INTO zset (key, member, score) VALUES (?, ?, ?) "
                "ON CONFLICT (key, member) DO UPDATE SET score = excluded.score",
                [
                    (key, m, float(score))
                    for key, scores in sets.items()
                    for m, score in scores.items()
                ],
            )

    def remove(self, key: str, members: Sequence[str]) -> None:
        with self._con() as con:
            con.executemany(
                "DELETE FROM zset WHERE key = ? AND member = ?", [(key, m) for m in members]
            )

    def range(
        self, key: str, offset: int, limit: int, desc: bool, max_score: float | None
    ) -> list[tuple[str, float]]:
        way = "DESC" if desc else "ASC"
        below = "" if max_score is None else " AND score <= ?"
        args: list[object] = [key] if max_score is None else [key, max_score]
        sql = (
            f"SELECT member, score FROM zset WHERE key = ?{below} "
            f"ORDER BY score {way}, member {way} LIMIT ? OFFSET ?"
        )
        return [(m, s) for m, s in self._con().execute(sql, (*args, limit, max(offset, 0)))]

    def count(self, key: str) -> int:
        row = self._con().execute("SELECT COUNT(*) FROM zset WHERE key = ?", (key,)).fetchone()
        return int(row[0])

    def close(self) -> None:
        con = getattr(self._local, "con", None)
        if con is not None:
            con.close()
            self._local.con = None
