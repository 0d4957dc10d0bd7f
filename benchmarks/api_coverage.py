"""Which torch APIs real model and training files call, and whether sbpflow has each (issue 32).

Reads the source (never imports it) of transformers' modeling files for Llama, Mixtral, GPT-2, ViT and BERT,
torchvision's ResNet, and nanoGPT's model.py and train.py, and lists with ``ast``:

* every dotted name under a torch module alias (``torch.cat``, ``nn.Linear``, ``F.softmax``, ``torch.float32``,
  ``from torch.nn import CrossEntropyLoss`` ...), cut to the longest prefix that torch itself has;
* every method called on something else whose name is a ``torch.Tensor`` method (``x.view(...)``), and every
  ``torch.Tensor`` property read (``x.shape``), as ``Tensor.<name>``; names that lists, dicts and sets have too
  (``index``, ``values``, ``add``) are left out, as a call on a dict is not a tensor call.

sbpflow has ``torch.A.B`` when ``sbpflow.A.B`` resolves, and ``Tensor.x`` when ``sbpflow.Tensor`` or
``sbpflow.nn.Module`` has ``x`` (``model.to(...)``, ``self.apply(...)``: torch's Module shares those names).

The sources: the transformers and torchvision wheels (``pip download --no-deps``, pinned below, into a temporary
folder, or ``--wheels DIR`` holding them), and nanoGPT's two files kept as text in ``benchmarks/sources/nanogpt``.

    PYTHONPATH=src python benchmarks/api_coverage.py            # print the table
    PYTHONPATH=src python benchmarks/api_coverage.py --write    # and write it into docs/api.md
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import sbpflow

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "api.md"
WHEELS = {"transformers": "5.24.0", "torchvision": "0.29.1"}
FILES = {  # shown name -> (wheel, path inside it)
    "Llama": ("transformers", "transformers/models/llama/modeling_llama.py"),
    "Mixtral": ("transformers", "transformers/models/mixtral/modeling_mixtral.py"),
    "GPT-2": ("transformers", "transformers/models/gpt2/modeling_gpt2.py"),
    "ViT": ("transformers", "transformers/models/vit/modeling_vit.py"),
    "BERT": ("transformers", "transformers/models/bert/modeling_bert.py"),
    "ResNet": ("torchvision", "torchvision/models/resnet.py"),
    "nanoGPT model": ("", "sources/nanogpt/model.py.txt"),
    "nanoGPT train": ("", "sources/nanogpt/train.py.txt"),
}
NOT_TENSOR_CALLS = {"index", "values", "add", "__init__"}  # a list's, dict's or set's method far more often
START, END = "<!-- api_coverage: begin -->", "<!-- api_coverage: end -->"


@dataclass(frozen=True)
class Use:
    api: str  # "torch.nn.Linear", "Tensor.view"
    file: str


def torch_aliases(tree: ast.AST) -> tuple[dict[str, str], list[str]]:
    """Local names bound to torch modules (``F`` -> ``torch.nn.functional``) and the torch names imported
    directly (``from torch.nn import CrossEntropyLoss`` -> ``torch.nn.CrossEntropyLoss``)."""
    aliases: dict[str, str] = {}
    direct: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module == "torch" or
                                                                  node.module.startswith("torch.")):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _is_module(full):
                    aliases[a.asname or a.name] = full
                else:
                    direct.append(full)
    return aliases, direct


def _is_module(dotted: str) -> bool:
    obj = _resolve(torch, dotted.split(".")[1:])
    return obj is not None and type(obj).__name__ == "module"


def _resolve(root: Any, parts: Iterable[str]) -> Any:
    obj = root
    for p in parts:
        try:
            obj = getattr(obj, p)
        except Exception:  # noqa: BLE001 (torch's lazy modules raise more than AttributeError)
            return None
    return obj


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None where the root is not a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def _torch_name(chain: list[str], aliases: dict[str, str]) -> str | None:
    """The longest prefix of ``chain`` (rooted at a torch alias) that torch has, as a dotted torch name."""
    base = aliases[chain[0]].split(".")
    parts = base + chain[1:]
    for n in range(len(parts), len(base) - 1, -1):
        if n > 1 and _resolve(torch, parts[1:n]) is not None:
            return ".".join(parts[:n])
    return None


TENSOR_METHODS = {n for n in dir(torch.Tensor) if not n.startswith("_")}


def uses(source: str, file: str) -> Iterator[Use]:
    tree = ast.parse(source)
    aliases, direct = torch_aliases(tree)
    for name in direct:
        yield Use(name, file)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(parents.get(node), ast.Attribute):
            continue  # only whole chains (a.b.c, not a.b inside it)
        chain = _chain(node)
        if chain and chain[0] in aliases:
            name = _torch_name(chain, aliases)
            if name:
                yield Use(name, file)
            continue
        if node.attr in TENSOR_METHODS and node.attr not in NOT_TENSOR_CALLS and not (chain and chain[0] == "self"
                                                                                     and len(chain) == 2):
            called = isinstance(parents.get(node), ast.Call) and parents[node].func is node  # type: ignore[attr-defined]
            is_property = not callable(getattr(torch.Tensor, node.attr, None)) or node.attr in ("T", "mT")
            if called or is_property:
                yield Use(f"Tensor.{node.attr}", file)


def sbpflow_has(api: str) -> bool:
    if api.startswith("Tensor."):
        name = api.split(".", 1)[1]
        return hasattr(sbpflow.Tensor, name) or hasattr(sbpflow.nn.Module, name)
    return _resolve(sbpflow, api.split(".")[1:]) is not None


def read_sources(wheel_dir: Path) -> dict[str, str]:
    wheels = {w: next(wheel_dir.glob(f"{w}-{v}-*.whl"), None) for w, v in WHEELS.items()}
    out = {}
    for shown, (wheel, path) in FILES.items():
        if not wheel:
            out[shown] = (HERE / path).read_text()
            continue
        found = wheels[wheel]
        if found is None:
            raise SystemExit(f"no {wheel} {WHEELS[wheel]} wheel in {wheel_dir}; run without --wheels to download")
        with zipfile.ZipFile(found) as z:
            out[shown] = z.read(path).decode()
    return out


def download(dest: Path) -> None:
    pins = [f"{w}=={v}" for w, v in WHEELS.items()]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), *pins], check=True)


def table(found: dict[str, set[str]]) -> tuple[str, float]:
    rows = sorted(found, key=lambda a: (not a.startswith("torch.nn"), a.startswith("Tensor."), a))
    have = [a for a in rows if sbpflow_has(a)]
    lines = ["| torch API | used by | sbpflow |", "|---|---|---|"]
    for api in rows:
        mark = "yes" if api in have else "**no**"
        lines.append(f"| `{api}` | {', '.join(sorted(found[api]))} | {mark} |")
    share = 100.0 * len(have) / len(rows) if rows else 100.0
    missing = [a for a in rows if a not in have]
    head = (f"**{len(have)} of {len(rows)} torch APIs ({share:.1f} %)** that the files below use exist in sbpflow"
            + (f"; missing: {', '.join(f'`{a}`' for a in missing)}." if missing else "."))
    files = ", ".join(f"{k} ({v[0] + ' ' + WHEELS[v[0]] if v[0] else 'karpathy/nanoGPT'})" for k, v in FILES.items())
    return "\n".join([head, "", f"Files read: {files}.", "", *lines]), share


def write(text: str) -> None:
    doc = DOC.read_text() if DOC.exists() else "# API\n"
    block = f"{START}\n{text}\n{END}"
    if START in doc:
        doc = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n## Torch APIs that real model files use\n\n" + block + "\n"
    DOC.write_text(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, help="a folder holding the pinned transformers and torchvision wheels")
    parser.add_argument("--write", action="store_true", help="write the table into docs/api.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel_dir = args.wheels or Path(tmp)
        if args.wheels is None:
            download(wheel_dir)
        sources = read_sources(wheel_dir)
    found: dict[str, set[str]] = defaultdict(set)
    for shown, source in sources.items():
        for use in uses(source, shown):
            found[use.api].add(use.file)
    text, share = table(found)
    print(text)
    print(f"\ncoverage: {share:.1f} %")
    if args.write:
        write(text)


if __name__ == "__main__":
    main()
