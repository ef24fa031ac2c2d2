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


@pytest.mark.parametrize("mode", ["reg", "reg-shared"])
def test_persistent_layers_decode_as_the_default_on_a_real_model(tmp_path, cuda_device, monkeypatch, mode):
    """llama3-1b bf16 built with persistent decode layers (``LUM_PERSISTENT=reg``, builder/persistent.py:
    register-fed, four blocks an SM; ``reg-shared``: their first weights through shared memory) and the default
    package, both teacher-forced on the default's greedy tokens, against transformers' f32 computation on the
    same weights over the same tokens: every decode step's logits of either package within 2e-2 of it (the
    bf16 bound of test_real_model_matches_transformers) or within transformers' own bf16 error at that step
    where that is larger, and the persistent package's median error no more than 1.25× the default's (its
    GEMVs may sum in another order, so bf16 activations round differently; on the H200 the logits of a removed
    persistent mode, the shared-memory ring, lay 0.6–1.1e-2 from the default's, 9e4a03a). Where their greedy
    tokens part, the default's top two logits must lie within twice the packages' largest difference there (each logit moved at most that much:
    a near tie flipped by rounding, not a wrong value). The tiny models' GPU variant case checks the same
    kernels at toy sizes; this one checks them at a real layer's grid, blocks an SM and split-K."""
    import torch

    import lum.loader
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package
    from tests.hf_checkpoints import save_hf_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model = save_hf_model("llama3-1b", tmp_path / "hf", dtype=torch.bfloat16, device="cuda", scale=1.0)
    spec = lambda: load_spec(src=str(tmp_path / "hf"), dtype="bf16", max_seq=96)   # noqa: E731
    default = build_package(spec(), tmp_path / "default.lumpkg")
    monkeypatch.setenv("LUM_PERSISTENT", mode)
    persistent = build_package(spec(), tmp_path / "persistent.lumpkg")
    pkg = lum.loader.open(persistent)
    assert any(op.tuning.get("persistent") for g in pkg.manifest.groups if g.table is not None for op in g.table.ops)

    prompt = [int(t) for t in np.random.default_rng(0).integers(3, model.config.vocab_size, 16)]
    steps = 48

    def decode_logits(path, tokens):
        """Each decode step's logits, feeding ``tokens`` (None: the package's own greedy tokens)."""
        out, fed = [], []
        with lum.loader.open(path).session(backend="cuda") as sess:
            sess.runner.fill_arena(0xFF)
            logits = sess.run("prefill", {"tokens": np.asarray(prompt, np.int32)}, {"s": len(prompt)})["logits"]
            for i in range(steps):
                tok = int(np.argmax(logits[-1])) if tokens is None else tokens[i]
                fed.append(tok)
                logits = sess.run("decode", {"tokens": np.asarray([tok], np.int32)}, {"p": len(prompt) + i})["logits"]
                out.append(np.asarray(logits[-1], np.float64))
        return out, fed

    want, fed = decode_logits(default, None)
    got, _ = decode_logits(persistent, fed)
    ids = torch.tensor([prompt + fed], device="cuda")
    with torch.no_grad():            # each position's logits: teacher-forced decode, in bf16 and in f32
        hf_bf16 = model(ids).logits[0, len(prompt):].double().cpu().numpy()
        exact = model.float()(ids).logits[0, len(prompt):].double().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    err_default = [_rel(w, e) for w, e in zip(want, exact)]
    err_persistent = [_rel(g, e) for g, e in zip(got, exact)]
    bound = [max(2e-2, _rel(h, e)) for h, e in zip(hf_bf16, exact)]   # or transformers' own bf16 error there
    apart = [_rel(g, w) for g, w in zip(got, want)]
    print(f"llama3-1b bf16 decode logits vs f32 over {steps} steps ({mode}): default max {max(err_default):.2e} median "
          f"{np.median(err_default):.2e}; persistent max {max(err_persistent):.2e} median "
          f"{np.median(err_persistent):.2e}; transformers bf16 median {np.median(bound):.2e}; the two apart max "
          f"{max(apart):.2e}")
    assert all(d < b and q < b for d, q, b in zip(err_default, err_persistent, bound)), (err_default, err_persistent)
    assert np.median(err_persistent) <= 1.25 * np.median(err_default), (err_default, err_persistent)
    for g, w in zip(got, want):
        if int(np.argmax(g)) != int(np.argmax(w)):
            top2 = np.sort(w)[-2:]
            assert top2[1] - top2[0] <= 2 * np.max(np.abs(g - w)), (top2, np.max(np.abs(g - w)))
