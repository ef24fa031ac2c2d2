"""Real-size models on the GPU: `lum build` from a transformers checkpoint, then the CUDA backend
against transformers on the same weights (the CUDA issue's acceptance for gemma3-4b and llama3-1b)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("real-models")]   # one worker: host and GPU memory

CASES = [  # (model, dtype, logits tolerance vs transformers, greedy steps that must agree)
    ("llama3-1b", "f32", 1e-4, 32),
    ("llama3-1b", "bf16", 2e-2, 0),
    ("gemma3-4b", "bf16", 2e-2, 0),
]
# bf16: transformers' own bf16 logits lie ~2.3% from its f32 logits on these random weights (measured
# on the H200, 2026-11-29), so two bf16 implementations that round at different points cannot agree
# within 2e-2. The bf16 bound is therefore taken against transformers' f32 computation on the same
# (bf16) weights: lum's bf16 package must be within 2e-2 of it — and closer than transformers' bf16.


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "lum logits contain NaN/inf"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name,dtype,tol,steps", CASES)
def test_real_model_matches_transformers(name, dtype, tol, steps, tmp_path, cuda_device, record_property):
    import torch

    import lum.loader
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package
    from tests.hf_checkpoints import save_hf_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    # Real-size models keep transformers' own initialisation (scale 1): widened weights make any bf16
    # implementation, transformers' included, drift several percent from the f32 result.
    model = save_hf_model(name, tmp_path / "hf", dtype=tdt, device="cuda", scale=1.0)
    pkg_path = build_package(load_spec(src=str(tmp_path / "hf"), dtype=dtype, max_seq=96), tmp_path / "m.lumpkg")

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, model.config.vocab_size, 16)]
    with torch.no_grad():
        want = model(torch.tensor([prompt], device="cuda")).logits[0].float().cpu().numpy()
        exact = model.float()(torch.tensor([prompt], device="cuda")).logits[0].cpu().numpy() if dtype != "f32" else want
        model.to(tdt)
        if steps:
            model.generation_config.eos_token_id = None
            ref_tokens = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=steps,
                                        do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    del model
    torch.cuda.empty_cache()

    pkg = lum.loader.open(pkg_path)
    with pkg.session(backend="cuda") as sess:
        got = sess.run("prefill", {"tokens": np.asarray(prompt, np.int32)}, {"s": len(prompt)})["logits"]
        err, vs_f32, hf_vs_f32 = _rel(got, want), _rel(got, exact), _rel(want, exact)
        print(f"{name} {dtype}: prefill logits rel err vs transformers {err:.2e}; vs f32: lum {vs_f32:.2e}, "
              f"transformers {hf_vs_f32:.2e}")
        detail = f"{name} {dtype}: rel err vs transformers {err:.2e} (vs f32: lum {vs_f32:.2e}, transformers {hf_vs_f32:.2e})"
        for key, value in (("rel_err_vs_transformers", err), ("lum_vs_f32", vs_f32), ("transformers_vs_f32", hf_vs_f32)):
            record_property(key, float(f"{value:.3e}"))          # kept in the gpu-tests record
        if dtype == "f32":
            assert err < tol, detail
        else:
            assert vs_f32 < tol and vs_f32 < hf_vs_f32, detail
        if steps:
            tokens = sess.generate(prompt, steps)
            assert tokens == ref_tokens, f"{name} {dtype}: lum {tokens} vs transformers {ref_tokens}"


