"""Golden snapshot of the pointwise kernels the ikbo pass generates for the zoo.

Each zoo model is compiled with pointwise fusion on (the default for GPU models); the programs
it fuses and the Triton source generated for each are compared with
``golden/zoo_pointwise.txt``. Regenerate after an intended change with
``ROCS_UPDATE_GOLDEN=1 python -m pytest tests/kernels/test_zoo_pointwise_golden.py``.
The compiled models must stay exact with the fused ops running on the CPU path.
"""

import os
import pathlib
import warnings

import torch

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.kernels import kernel_source

GOLDEN = pathlib.Path(__file__).parent / "golden" / "zoo_pointwise.txt"


def _snapshot_and_check() -> str:
    sections = []
    for name, entry in ZOO.items():
        model = entry.build(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = rocs.compile(
                model, entry.request_inputs, example_kwargs=entry.make_batch([4, 3]).replicated(),
                options={"ikbo_pointwise": True},
            )
        batch = entry.make_batch([3, 1, 2], seed=7, shuffle=True)
        with torch.no_grad():
            expected = torch.utils._pytree.tree_leaves(model(**batch.replicated()))
        got = torch.utils._pytree.tree_leaves(
            cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        )
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        fused = [
            n.args for n in cm.graph_module.graph.nodes
            if n.target == torch.ops.rocs.broadcast_pointwise.default
        ]
        for program, cands, reqs, _ in fused:
            sections.append(f"### {name}: {program}\n{kernel_source(program, len(cands), len(reqs))}")
    return "\n".join(sections)


def test_zoo_pointwise_kernels_match_golden():
    text = _snapshot_and_check()
    assert text, "pointwise fusion fired on no zoo model"
    if os.environ.get("ROCS_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert GOLDEN.read_text() == text
