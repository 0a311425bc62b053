"""The overlap report's check (`jaxdp.planner.tbo_report`), both ways, on scheduled HLO written out by hand in
XLA:GPU's form: a collective of one micro-batch with the other's compute between its start and its done passes;
one with only its own compute inside, one run synchronously, and a program without the split (no micro-batch
scopes) fail. The full-size report (XLA:GPU, DeepSeek-V3) is docs/tbo.md's."""

from jaxdp.planner.tbo_report import format_report, micro_batch_of, overlap_report


def _hlo(inside_scope: str | None, sync: bool = False) -> str:
    meta = 'metadata={{op_name="jit(step)/while/body/{}/moe/dot"}}'
    scoped = {k: meta.format(f"tbo_mb{k}") for k in (0, 1)}
    inside = f'metadata={{op_name="jit(step)/while/body/{inside_scope}/mla/fusion"}}' if inside_scope else ""
    collective = (f"  %a2a = bf16[8,16]{{1,0}} all-to-all(bf16[8,16]{{1,0}} %p), dimensions={{0}}, {scoped[0]}"
                  if sync else
                  f"  %a2a-start = (bf16[8,16]{{1,0}}, bf16[8,16]{{1,0}}) all-to-all-start(bf16[8,16]{{1,0}} %p), "
                  f"{scoped[0]}\n"
                  f"  %work = bf16[8,16]{{1,0}} fusion(bf16[8,16]{{1,0}} %q), kind=kLoop, calls=%fused, {inside}\n"
                  f"  %a2a-done = bf16[8,16]{{1,0}} all-to-all-done((bf16[8,16]{{1,0}}, bf16[8,16]{{1,0}}) "
                  f"%a2a-start), {scoped[0]}")
    return (
        "%fused (x: bf16[8,16]) -> bf16[8,16] {\n"
        "  %x = bf16[8,16]{1,0} parameter(0)\n"
        "  ROOT %n = bf16[8,16]{1,0} negate(bf16[8,16]{1,0} %x)\n"
        "}\n\n"
        "ENTRY %main (p: bf16[8,16], q: bf16[8,16]) -> bf16[8,16] {\n"
        "  %p = bf16[8,16]{1,0} parameter(0)\n"
        "  %q = bf16[8,16]{1,0} parameter(1)\n"
        f"{collective}\n"
        "  ROOT %r = bf16[8,16]{1,0} copy(bf16[8,16]{1,0} %q)\n"
        "}\n")


def test_other_micro_batch_inside_passes():
    report = overlap_report(_hlo("tbo_mb1"))
    assert report["ok"] and report["total"] == 1 and report["overlapped"] == 1
    (row,) = report["collectives"]
    assert (row["op"], row["micro_batch"], row["async"], row["other_compute"]) == ("all-to-all", 0, True, 1)
    assert "goal met" in format_report("decode split", report)[0]


def test_own_compute_sync_or_no_split_fails():
    own = overlap_report(_hlo("tbo_mb0"))  # its own compute inside: nothing of the other micro-batch overlaps it
    assert not own["ok"] and own["collectives"][0]["other_compute"] == 0
    assert not overlap_report(_hlo(None))["ok"]
    sync = overlap_report(_hlo("tbo_mb1", sync=True))
    assert not sync["ok"] and sync["collectives"][0]["async"] is False
    whole = overlap_report(_hlo("tbo_mb1").replace("tbo_mb", "layer"))  # a step without the split
    assert not whole["ok"] and whole["total"] == 0
    assert "goal NOT met" in format_report("decode whole", whole)[0]
    assert micro_batch_of('op_name="a/tbo_mb1/b"') == 1 and micro_batch_of('op_name="a/b"') is None
    assert micro_batch_of('op_name="a/lm_head_mb0/all_gather"') == 0  # the LM head, run per micro-batch


def test_combined_collective_of_both_micro_batches_fails():
    """XLA's combiners merge the two micro-batches' independent all-gathers into one (its op_name names both
    scopes): each micro-batch then waits for the other's, so it is not an overlapped micro-batch collective."""
    both = 'metadata={op_name="jit(step)/(tbo_mb0/all_gather:tbo_mb1/all_gather)"}'
    hlo = _hlo("tbo_mb1").replace('metadata={op_name="jit(step)/while/body/tbo_mb0/moe/dot"}', both)
    report = overlap_report(hlo)
    (row,) = report["collectives"]
    assert row["micro_batch"] == "both" and row["other_compute"] == 0 and not report["ok"]
    assert "combined" in format_report("decode split", report)[2]


def _ragged(reader_scope: str, feeder_scope: str) -> str:
    """A ragged all-to-all without metadata (as XLA:GPU writes it, operands by name), fed by `feeder_scope`'s gather
    and read by a fusion traced in `reader_scope`, with micro-batch 0's compute inside."""
    def meta(scope, op):
        return f'metadata={{op_name="jit(step)/{scope}/{op}"}}'
    return (
        "ENTRY %main (p: s32[16], q: bf16[8,16]) -> s32[16] {\n"
        "  %p = s32[16]{0} parameter(0)\n"
        "  %q = bf16[8,16]{1,0} parameter(1)\n"
        f"  %send = s32[16]{{0}} fusion(s32[16]{{0}} %p), kind=kLoop, calls=%f, {meta(feeder_scope, 'gather')}\n"
        "  %ra-start = ((s32[16]{0}, s32[16]{0}), s32[16]{0}) ragged-all-to-all-start(%send, %p)\n"
        f"  %work = bf16[8,16]{{1,0}} fusion(bf16[8,16]{{1,0}} %q), kind=kLoop, calls=%g, {meta('tbo_mb0', 'dot')}\n"
        "  %ra-done = s32[16]{0} ragged-all-to-all-done(%ra-start)\n"
        f"  ROOT %use = s32[16]{{0}} fusion(s32[16]{{0}} %ra-done), kind=kLoop, calls=%f, "
        f"{meta(reader_scope, 'select_n')}\n"
        "}\n")


def test_unlabelled_collective_takes_its_feeders_micro_batch():
    """XLA fuses the two micro-batches' selects into one instruction that carries one micro-batch's name: the
    collective's own buffers (what feeds it) say whose it is, so micro-batch 1's exchange with micro-batch 0's
    compute inside is overlapped, though a fusion named for micro-batch 0 reads it."""
    report = overlap_report(_ragged(reader_scope="tbo_mb0", feeder_scope="tbo_mb1"))
    (row,) = report["collectives"]
    assert (row["op"], row["micro_batch"], row["other_compute"]) == ("ragged-all-to-all", 1, 1) and report["ok"]
    own = overlap_report(_ragged(reader_scope="tbo_mb0", feeder_scope="tbo_mb0"))
    assert own["collectives"][0]["micro_batch"] == 0 and not own["ok"]
    unnamed = overlap_report(_ragged(reader_scope="tbo_mb1", feeder_scope="x"))  # then the reader decides
    assert unnamed["collectives"][0]["micro_batch"] == 1 and unnamed["ok"]
