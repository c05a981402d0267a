"""The artifact trail: which files a span's tool calls read, wrote, edited, created or
deleted (#26). Pure.

Published compaction evaluations find every vendor weakest here: after a compaction the
agent no longer knows which files it touched. The calls are read from the transcript text
(``messages.render``: ``ASSISTANT called tool NAME(ARGS) [id ...]``), which is the same for
all three surfaces, so one parser serves chat completions, messages and responses. Tool
names and argument shapes are those of the common agents: Claude Code (Read, Write, Edit,
MultiEdit, NotebookEdit, Bash), Codex (apply_patch, shell, exec_command), SWE-agent and
OpenHands (str_replace_editor, bash), and the generic read_file / write_file family.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

import orjson

READ, WRITTEN, EDITED, CREATED, DELETED = "read", "written", "edited", "created", "deleted"
CHANGED = frozenset({WRITTEN, EDITED, CREATED, DELETED})

_BY_NAME = {
    "read": READ, "read_file": READ, "readfile": READ, "view": READ, "view_file": READ,
    "open_file": READ, "cat": READ, "get_file_contents": READ, "read_many_files": READ,
    "write": WRITTEN, "write_file": WRITTEN, "writefile": WRITTEN, "write_to_file": WRITTEN,
    "create_file": CREATED, "create": CREATED, "touch": CREATED,
    "edit": EDITED, "multiedit": EDITED, "edit_file": EDITED, "str_replace": EDITED,
    "replace_in_file": EDITED, "apply_diff": EDITED, "notebookedit": EDITED, "insert": EDITED,
    "delete_file": DELETED, "remove_file": DELETED, "rm": DELETED,
}  # fmt: skip
# str_replace_editor's (SWE-agent, OpenHands) sub-commands.
_EDITOR = {"view": READ, "create": CREATED, "str_replace": EDITED, "insert": EDITED}
_PATH_KEYS = ("path", "file_path", "filePath", "file", "filename", "notebook_path", "target_file")
_SHELL_NAMES = frozenset({"bash", "shell", "exec_command", "run_shell_command", "terminal"})
_CALL_RE = re.compile(r"called tool ([^\s(]+)\((.*)\) \[id [^\]\n]*\]$", re.MULTILINE)
_PATCH_RE = re.compile(r"^\*\*\* (Add|Update|Delete) File: (\S+)|^\*\*\* Move to: (\S+)", re.M)
_PATCH_ACTIONS = {"Add": CREATED, "Update": EDITED, "Delete": DELETED}
_READERS = frozenset({"cat", "head", "tail", "less", "more", "nl", "bat", "wc"})
_PATHLIKE = re.compile(r"^[\w.~/-]*[\w-]\.[A-Za-z0-9]{1,8}$|^[\w.~-]*/[\w./-]+$")


@dataclass(frozen=True)
class Artifact:
    """One file a call touched, and how."""

    action: str  # READ, WRITTEN, EDITED, CREATED or DELETED
    path: str
    at: int  # offset of the call in the text

    @property
    def label(self) -> str:
        return f"{self.action} {self.path}"


def _parse(raw: str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw


def _patch(text: str) -> list[tuple[str, str]]:
    out = []
    for m in _PATCH_RE.finditer(text):
        out.append(
            (_PATCH_ACTIONS[m.group(1)], m.group(2)) if m.group(1) else (CREATED, m.group(3))
        )
    return out


def shell_files(command: str) -> list[tuple[str, str]]:
    """(action, path) pairs a shell command line states plainly: ``cat``/``head``/``sed -n``
    read, ``>``/``>>``/``tee`` write, ``sed -i`` edits, ``rm`` deletes, ``touch`` creates,
    and a heredoc ``apply_patch`` (older Codex). Anything else is not guessed at."""
    found = _patch(command)
    for part in re.split(r"&&|\|\||;|\n|\|", command):
        try:
            words = shlex.split(part, comments=False)
        except ValueError:
            words = part.split()
        if not words:
            continue
        targets = set()
        for i, w in enumerate(words[:-1]):
            if w in (">", ">>") and _PATHLIKE.match(words[i + 1]):
                found.append((WRITTEN, words[i + 1]))
                targets.add(words[i + 1])
        head, args = words[0], [w for w in words[1:] if not w.startswith(("-", "<", ">"))]
        # ``cat > x.py`` writes x.py; it does not read it.
        if head == "sed" and "-e" not in words and args:
            args = args[1:]  # the first operand is the script (s/a/b/), not a file
        paths = [a for a in args if _PATHLIKE.match(a) and a not in targets]
        if head in _READERS or (head == "sed" and "-i" not in words):
            found += [(READ, p) for p in paths if not p.startswith(("/dev/",))]
        elif head == "sed":
            found += [(EDITED, p) for p in paths]
        elif head == "tee":
            found += [(WRITTEN, p) for p in paths]
        elif head == "rm":
            found += [(DELETED, p) for p in paths]
        elif head == "touch":
            found += [(CREATED, p) for p in paths]
    return found


def _command(args: Any) -> str:
    if isinstance(args, dict):
        value = args.get("command", args.get("cmd", ""))
    else:
        value = args
    if isinstance(value, list):  # ["bash", "-lc", "cat x"] (Codex)
        return str(value[-1]) if value else ""
    return value if isinstance(value, str) else ""


def call_files(name: str, args: Any) -> list[tuple[str, str]]:
    """(action, path) pairs of one tool call, from its name and its parsed arguments."""
    key = name.lower()
    if key == "apply_patch":
        text = args.get("input", args.get("patch", "")) if isinstance(args, dict) else args
        return _patch(str(text))
    if key in _SHELL_NAMES:
        return shell_files(_command(args))
    if not isinstance(args, dict):
        return []
    action = _BY_NAME.get(key)
    if key == "str_replace_editor" or (action is None and "command" in args and "path" in args):
        action = _EDITOR.get(str(args.get("command")))
    if action is None:
        return []
    paths = [str(args[k]) for k in _PATH_KEYS if isinstance(args.get(k), str)]
    if isinstance(args.get("paths"), list):
        paths += [str(p) for p in args["paths"] if isinstance(p, str)]
    for edit in args.get("edits") or [] if key == "multiedit" else []:
        if isinstance(edit, dict) and isinstance(edit.get("file_path"), str):
            paths.append(edit["file_path"])
    return [(action, p) for p in dict.fromkeys(paths)]


def trail(text: str) -> list[Artifact]:
    """Every file the tool calls rendered in ``text`` touched, in order, once per (action,
    path); a file both read and changed is listed under each."""
    seen: dict[tuple[str, str], Artifact] = {}
    for m in _CALL_RE.finditer(text):
        for action, path in call_files(m.group(1), _parse(m.group(2))):
            seen.setdefault((action, path), Artifact(action, path, m.start()))
    return list(seen.values())
