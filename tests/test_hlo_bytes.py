"""scripts/hlo_bytes.py on small hand-written HLO modules, against bytes counted by hand."""
from tests.script_loader import load_script

hlo_bytes = load_script("hlo_bytes")

WHILE = """HloModule loop

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[256]{0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[256]{0} exponential(%x)
  ROOT %t = (s32[], f32[256]{0}) tuple(%next, %y)
}

%cond (q: (s32[], f32[256])) -> pred[] {
  %q = (s32[], f32[256]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%zero, %a)
  %w = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config=TRIPS
  ROOT %out = f32[256]{0} get-tuple-element(%w), index=1
}
""".replace("TRIPS", '{"known_trip_count":{"n":"8"}}')  # as XLA writes it, on one line

SLICE = """HloModule slice

%fused_slice (param_0: f32[16,1024], param_1: s32[]) -> f32[1,1024] {
  %param_0 = f32[16,1024]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%param_0, %param_1, %c0), dynamic_slice_sizes={1,1024}
}

ENTRY %main (cache: f32[16,1024], idx: s32[]) -> f32[1,1024] {
  %cache = f32[16,1024]{1,0} parameter(0)
  %idx = s32[] parameter(1)
  ROOT %f = f32[1,1024]{1,0} fusion(%cache, %idx), kind=kLoop, calls=%fused_slice
}
"""

UPDATE = """HloModule update

%fused_update (param_0: bf16[16,1024], param_1: f32[1,1024], param_2: s32[]) -> bf16[16,1024] {
  %param_0 = bf16[16,1024]{1,0} parameter(0)
  %param_1 = f32[1,1024]{1,0} parameter(1)
  %row = bf16[1,1024]{1,0} convert(%param_1)
  %param_2 = s32[] parameter(2)
  %c0 = s32[] constant(0)
  ROOT %dus = bf16[16,1024]{1,0} dynamic-update-slice(%param_0, %row, %param_2, %c0)
}

ENTRY %main (cache: bf16[16,1024], new: f32[1,1024], idx: s32[]) -> bf16[16,1024] {
  %cache = bf16[16,1024]{1,0} parameter(0)
  %new = f32[1,1024]{1,0} parameter(1)
  %idx = s32[] parameter(2)
  ROOT %f = bf16[16,1024]{1,0} fusion(%cache, %new, %idx), kind=kLoop, calls=%fused_update
}
"""

CUSTOM = """HloModule custom

ENTRY %main (q: f32[64,128], k: f32[1000,128]) -> f32[64,128] {
  %q = f32[64,128]{1,0} parameter(0)
  %k = f32[1000,128]{1,0} parameter(1)
  %cc = f32[64,128]{1,0} custom-call(%q, %k), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %neg = f32[64,128]{1,0} negate(%cc)
}
"""


def by_name(moved) -> dict:
    return {r.name: r for r in moved.launches}


def test_while_body_counts_known_trip_count_times():
    moved = hlo_bytes.bytes_moved(WHILE)
    rows = by_name(moved)
    # exp: 256 f32 read + written = 2,048 B, 8 trips
    assert (rows["y"].count, rows["y"].bytes) == (8, 8 * 2048)
    # add: result + two s32 operands = 12 B, 8 trips; compare: pred + two s32 = 9 B, 9 runs
    assert (rows["next"].bytes, rows["lt"].count, rows["lt"].bytes) == (8 * 12, 9, 9 * 9)
    assert moved.total == 8 * 2048 + 8 * 12 + 9 * 9
    assert moved.custom_calls == []


def test_fusion_reading_a_parameter_through_a_dynamic_slice_counts_the_slice():
    moved = hlo_bytes.bytes_moved(SLICE)
    # the 4 KB row read (not the 64 KB cache), the 4 B index, the 4 KB row written
    assert [(r.name, r.bytes) for r in moved.launches] == [("f", 4096 + 4 + 4096)]


def test_in_place_dynamic_update_slice_counts_the_update():
    moved = hlo_bytes.bytes_moved(UPDATE)
    # reads the f32 row (4 KB) and the index (4 B), writes the bf16 row (2 KB) in place;
    # the 32 KB cache is neither read nor written whole
    assert moved.total == 4096 + 4 + 2048


def test_custom_call_is_listed_apart():
    moved = hlo_bytes.bytes_moved(CUSTOM)
    [call] = moved.custom_calls
    # operands (32 KB + 500 KB) and result (32 KB): an upper bound on what the kernel reads
    assert (call.name, call.count, call.bytes) == ("cc", 1, 32768 + 512000 + 32768)
    assert moved.total == 2 * 32768  # the negate alone


def test_cli_prints_the_total(tmp_path, capsys):
    path = tmp_path / "m.txt"
    path.write_text(SLICE)
    moved = hlo_bytes.main([str(path), "--top", "1"])
    assert moved.total == 8196
    assert "total (without custom calls) 0.0 MB" in capsys.readouterr().out
