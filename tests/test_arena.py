"""Arena planning: live buffers never overlap, aliases share storage, reuse makes the arena smaller."""

from hypothesis import given, settings, strategies as st

from lum.loader.arena import ALIGN, BufferRequest, plan_arena


@st.composite
def requests(draw):
    n = draw(st.integers(1, 25))
    out = []
    for i in range(n):
        first = draw(st.integers(0, 30))
        last = draw(st.integers(first, 40))
        alias = None
        if out and draw(st.booleans()) and draw(st.booleans()):
            target = draw(st.sampled_from(out))
            alias = target.name
            size = draw(st.integers(0, target.size))
        else:
            size = draw(st.integers(0, 5000))
        out.append(BufferRequest(f"b{i}", size, first, last, alias))
    return out


@settings(max_examples=300, deadline=None)
@given(requests())
def test_live_buffers_never_overlap(reqs):
    plan = plan_arena(reqs)
    by = {r.name: r for r in reqs}

    def span(name):
        members = [r for r in reqs if plan.roots.get(r.name, r.name) == name]
        return min(r.first for r in members), max(r.last for r in members)

    roots = [r.name for r in reqs if r.name not in plan.roots]
    for r in reqs:
        assert plan.offsets[r.name] % ALIGN == 0
        assert plan.offsets[r.name] + r.size <= plan.size
        if r.alias_of:
            assert plan.offsets[r.name] == plan.offsets[plan.roots[r.name]]
    for i, a in enumerate(roots):
        for b in roots[i + 1:]:
            (fa, la), (fb, lb) = span(a), span(b)
            if la < fb or lb < fa or by[a].size == 0 or by[b].size == 0:
                continue
            oa, ob = plan.offsets[a], plan.offsets[b]
            assert oa + by[a].size <= ob or ob + by[b].size <= oa, (a, b)
    assert plan.size <= plan.unshared_size


def test_reuse_shrinks_a_chain():
    reqs = [BufferRequest(f"t{i}", 1024, i, i + 1) for i in range(10)]
    plan = plan_arena(reqs)
    assert plan.size == 2 * 1024 < plan.unshared_size
