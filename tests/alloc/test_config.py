import pytest
from hypothesis import given, settings, strategies as st

from alloc import ArenaOutOfMemory, Config, ConfigError, from_env, workspace_arena
from alloc.config import ENV_VAR, VLLM_BUDGET_VAR, parse


def test_defaults_and_values():
    assert from_env({}) == Config()
    c = from_env({ENV_VAR: " budget_mb:64 , alignment:1024,unified:on,host_headroom_mb:0,trace:100"})
    assert (c.budget_mb, c.alignment, c.unified, c.host_headroom_mb, c.trace) == (64, 1024, "on", 0, 100)
    assert c.budget_bytes == 64 << 20
    assert Config().expandable == "auto"
    assert [from_env({ENV_VAR: f"expandable:{v}"}).expandable for v in ("on", "off", "auto")] == ["on", "off", "auto"]


def test_vllm_budget_variable():
    assert from_env({VLLM_BUDGET_VAR: "256"}).budget_mb == 256
    assert from_env({VLLM_BUDGET_VAR: "256", ENV_VAR: "budget_mb:256"}).budget_mb == 256
    with pytest.raises(ConfigError, match="disagree") as e:
        from_env({VLLM_BUDGET_VAR: "256", ENV_VAR: "budget_mb:512"})
    assert e.value.key == "budget_mb"
    with pytest.raises(ConfigError, match=f"{VLLM_BUDGET_VAR}.*greater than zero"):
        from_env({VLLM_BUDGET_VAR: "0"})


@pytest.mark.parametrize("text, key, value, reason", [
    ("budget_mb:0", "budget_mb", "0", "greater than zero"),
    ("budget_mb:-5", "budget_mb", "-5", "greater than zero"),
    ("budget_mb:12.5", "budget_mb", "12.5", "not an integer"),
    ("budget_mb:lots", "budget_mb", "lots", "not an integer"),
    ("alignment:8", "alignment", "8", "power of two"),
    ("alignment:96", "alignment", "96", "power of two"),
    ("unified:maybe", "unified", "maybe", "one of auto, on, off"),
    ("expandable:true", "expandable", "true", "one of auto, on, off"),
    ("host_headroom_mb:-1", "host_headroom_mb", "-1", "not be negative"),
    ("trace:x", "trace", "x", "not an integer"),
    ("meminfo:", "meminfo", "", "not be empty"),
    ("budgetmb:10", "budgetmb", "10", "unknown key"),
    ("budget_mb", "budget_mb", "budget_mb", "missing ':'"),
    ("budget_mb:1,budget_mb:2", "budget_mb", "2", "given twice"),
])
def test_bad_values_name_the_key_the_value_and_what_is_accepted(text, key, value, reason):
    with pytest.raises(ConfigError) as e:
        parse(text)
    msg = str(e.value)
    assert e.value.key == key and e.value.value == value
    assert f"invalid value {value!r} for {key!r}" in msg
    assert reason in msg and "accepted:" in msg and ENV_VAR in msg


def test_replace_checks_like_the_environment():
    assert Config().replace(budget_mb=32).budget_mb == 32
    with pytest.raises(ConfigError, match="greater than zero"):
        Config().replace(budget_mb=0)
    with pytest.raises(ConfigError, match="unknown key"):
        Config().replace(budget=32)


def test_to_env_round_trips():
    c = Config(budget_mb=64, unified="on", oom_report="/tmp/r.json", expandable="off")
    assert from_env({ENV_VAR: c.to_env()}) == c


def test_budget_over_what_the_backend_can_reserve_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        workspace_arena(Config(budget_mb=1 << 30))
    msg = str(e.value)
    assert e.value.key == "budget_mb" and "1073741824" in msg and "MiB of host memory" in msg


def test_workspace_arena_follows_the_config():
    with workspace_arena(Config(budget_mb=2, alignment=4096)) as a:
        assert a.stats()["capacity"] == 2 << 20 and a.allocate(1) % 4096 == 0
        with pytest.raises(ArenaOutOfMemory):
            a.allocate(2 << 20)


# -- every value of the class, not the instances above -------------------------------------------
from hypothesis import given, strategies as st  # noqa: E402

from alloc.config import KEYS, MAX_MIB  # noqa: E402

INT_KEYS = {"budget_mb": (1, MAX_MIB), "host_headroom_mb": (0, MAX_MIB), "trace": (0, 1 << 32)}


@given(key=st.sampled_from(sorted(INT_KEYS)), text=st.text(max_size=12))
def test_an_integer_key_takes_ascii_digits_in_range_and_nothing_else(key, text):
    low, high = INT_KEYS[key]
    plain = text.strip()
    digits = plain[1:] if plain.startswith("-") else plain
    good = digits.isascii() and digits.isdigit() and low <= int(plain) <= high
    try:
        value = parse(f"{key}:{text}")[key]
    except ConfigError as e:
        assert not good and e.key == key and "accepted:" in str(e)
    else:
        assert good and value == int(plain)


@given(key=st.sampled_from(sorted(INT_KEYS)), value=st.integers(-(1 << 70), 1 << 70))
def test_a_config_made_in_python_is_checked_as_the_environment_is(key, value):
    low, high = INT_KEYS[key]
    try:
        made = Config(**{key: value})
    except ConfigError as e:
        assert not low <= value <= high and e.key == key
    else:
        assert low <= value <= high and getattr(made, key) == value
        assert from_env({ENV_VAR: made.to_env()}) == made


@given(st.one_of(st.booleans(), st.floats(allow_nan=True), st.none(), st.lists(st.integers(), max_size=1)))
def test_a_config_refuses_values_of_the_wrong_type(value):
    for key in ("budget_mb", "alignment", "trace", "unified", "expandable"):
        with pytest.raises(ConfigError) as e:
            Config(**{key: value})
        assert e.value.key == key


@pytest.mark.parametrize("text", ["1_0", "١٢", "+5", " 0x10", "1e3", "٣"])
def test_numbers_in_other_spellings_are_refused(text):
    with pytest.raises(ConfigError, match="digits 0-9"):
        parse(f"budget_mb:{text}")
    assert set(KEYS) >= set(INT_KEYS)


def test_config_defaults_are_the_key_table():
    import dataclasses

    from alloc.config import KEYS
    fields = dataclasses.fields(Config)
    assert [f.name for f in fields] == list(KEYS)
    assert {f.name: f.default for f in fields} == {k.name: k.default for k in KEYS.values()}


def test_the_documented_configuration_table_is_the_key_table():
    from alloc.config import markdown_keys
    from tests.support import ROOT
    readme = (ROOT / "docs" / "configuration.md").read_text()
    start = readme.index("| key | default | meaning |")
    end = readme.find("\n\n", start)
    assert readme[start:end if end >= 0 else None].rstrip("\n") == markdown_keys()


# -- path keys: what the C core opens must be the whole path -------------------------------------
import os  # noqa: E402

PATH_KEYS = sorted(name for name, key in KEYS.items() if "path" in key.accepted)
ODD = st.sampled_from(["\0", "\udcff", "\ud800", "é", " ", ":", "/"])  # \udcff: a byte os.fsdecode could not decode


@given(key=st.sampled_from(PATH_KEYS), text=st.lists(st.one_of(ODD, st.characters(exclude_characters=",")),
                                                     max_size=12).map("".join))
def test_a_path_key_takes_exactly_the_paths_c_can_open_whole(key, text):
    assert PATH_KEYS == ["meminfo", "oom_report", "trace_file"]
    value = text.strip()
    try:
        raw = os.fsencode(value)
    except UnicodeEncodeError:
        raw = None
    good = bool(value) and raw is not None and b"\0" not in raw
    for make in (lambda: parse(f"{key}:{text}")[key], lambda: getattr(Config(**{key: value}), key)):
        try:
            got = make()
        except ConfigError as e:
            assert not good and e.key == key and "accepted:" in str(e), str(e)
            if "\0" in value:
                assert f"NUL byte at position {value.index(chr(0))}" in str(e)
        else:
            assert good and got == value


def test_a_nul_byte_in_a_path_key_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        from_env({ENV_VAR: "meminfo:/proc/meminfo\0/x"})
    assert str(e.value) == ("invalid value '/proc/meminfo\\x00/x' for 'meminfo' (from INDEXER_ARENA_CONF): "
                            "a NUL byte at position 13 would end the path there in C; accepted: a path to a "
                            "file in /proc/meminfo format")


@settings(max_examples=40, deadline=None)
@given(piece=st.text(min_size=1, max_size=3).filter(lambda t: not set(t) & set(",:")),
       length=st.one_of(st.integers(0, 200), st.sampled_from([81, 5000, 8 << 20])),
       where=st.sampled_from(["value", "key", "no colon", "vllm", "scope"]))
def test_a_setting_of_any_length_is_refused_in_one_bounded_line(piece, length, where):
    """However long the bad text in INDEXER_ARENA_CONF (a value, a key, a key without its value), in
    VLLM_SPARSE_INDEXER_MAX_LOGITS_MB or in INDEXER_ARENA_SCOPE, the refusal quotes an excerpt."""
    from alloc.engine_plugin import SCOPE_VAR, scope_from_env
    bad = (piece * (length // len(piece) + 1))[:length] + "z"
    environ = {"value": {ENV_VAR: f"budget_mb:{bad}"}, "key": {ENV_VAR: f"{bad}:1"},
               "no colon": {ENV_VAR: f"budget_mb{bad}"}, "vllm": {VLLM_BUDGET_VAR: bad},
               "scope": {SCOPE_VAR: bad}}[where]
    with pytest.raises(ConfigError) as e:
        scope_from_env(environ) if where == "scope" else from_env(environ)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)[:400]
