"""Result files written atomically (a kill leaves the old file or the new one, never a torn one), and read back.

Each writer writes `<path>.tmp` in the same directory and renames it over `path` (`os.replace`, atomic on POSIX
file systems), so a reader (a rerun that skips finished runs, a plotting script) sees a complete file or none.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional


def write_text(path: str, text: str) -> None:
  with open(path + '.tmp', 'w') as f:
    f.write(text)
  os.replace(path + '.tmp', path)


def write_json(path: str, value: Any, indent: Optional[int] = None) -> None:
  write_text(path, json.dumps(value, indent=indent))


def read_json(path: str) -> Optional[dict]:
  """The JSON object in `path`, or None if it is missing or does not read back (a file torn by a crash of a
  version that wrote it in place: its run is then not finished, and runs again from its checkpoint)."""
  try:
    with open(path) as f:
      value = json.load(f)
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None


def save_figure(figure, path: str, **savefig_kwargs) -> None:
  """`figure.savefig(path)` atomically (the format from `path`'s extension, as savefig would infer it)."""
  image_format = os.path.splitext(path)[1].lstrip('.') or None
  with open(path + '.tmp', 'wb') as f:
    figure.savefig(f, format=image_format, **savefig_kwargs)
  os.replace(path + '.tmp', path)
