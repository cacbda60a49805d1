"""Output paths checked before the work that fills them, so that a bad path costs nothing and
leaves nothing half-written."""

from __future__ import annotations

import os


def unwritable(path: str, flag: str) -> str | None:
    """Why ``path`` (given to ``flag``) cannot be written, or None when it can. '-' is standard
    output. The file itself is not created."""
    if path == "-":
        return None
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory; give a file name"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag} {path}: the folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path}: not writable here"
    return None
