import pytest

from decoder.config import ConfigError, DecodeConfig


def test_toml_round_trip():
    cfg = DecodeConfig(method="sd", drafter="ngram", draft_len=7, temperature=0.7, seed=3, max_new_tokens=99,
                       dtype="float32", stop_at_eos=False)
    back = DecodeConfig.from_toml(cfg.to_toml())
    assert back == cfg
    assert "[decode]" in cfg.to_toml()


def test_int_accepted_for_float_field():
    assert DecodeConfig.from_toml("[decode]\ntemperature = 1\n").temperature == 1.0


@pytest.mark.parametrize("text, needle", [
    ("[decode]\ndraft_len = 0\n", "draft_len = 0"),
    ("[decode]\ndrafter = \"eagle\"\n", "drafter = 'eagle'"),
    ("[decode]\nbogus = 1\n", "unknown key(s) bogus"),
    ("[decode]\ndraft_len = \"4\"\n", "draft_len = '4' should be of type int"),
    ("[decode]\ntemperature = -1.0\n", "temperature = -1.0"),
])
def test_bad_values_name_key_and_value(text, needle):
    with pytest.raises(ConfigError) as e:
        DecodeConfig.from_toml(text)
    assert needle in str(e.value)


def test_registry_keys_are_config_keys_and_stock_is_default():
    from dataclasses import fields

    from decoder.contract import GAP_FAMILIES
    from decoder.mechanisms import REGISTRY, stock_config, validate_change

    names = {f.name for f in fields(DecodeConfig)}
    stock = stock_config()
    for m in REGISTRY.values():
        assert m.family in GAP_FAMILIES
        assert set(m.keys) <= names
        for k, v in m.stock.items():
            assert getattr(stock, k) == v, (m.name, k)
    validate_change({"lean_forward": True, "draft_len": 4})
    with pytest.raises(ValueError, match="draft_len = 99"):
        validate_change({"draft_len": 99})
    with pytest.raises(ValueError, match="dtype is not a mechanism key"):
        validate_change({"dtype": "float16"})


def test_registry_families_match_cost_model():
    from costmodel.gaps import FAMILIES
    from decoder.contract import GAP_FAMILIES

    assert tuple(GAP_FAMILIES) == tuple(FAMILIES)


def test_tables_with_keys_and_values_a_candidate_wrote_round_trip_without_injection():
    """A candidate's system.toml may hold keys this schema does not know and any string: dump_table writes
    them back as they were (no key injected through a quote or a newline), verify_width stays bounded."""
    from decoder.config import MAX_TREE_NODES, dump_table, read_table, verify_width

    table = {"method": "sd", "my_knob": 'x"\nmethod = "ar', "path": "C:\\tmp\\é", "ks": [1, 2], "on": True}
    back = read_table(dump_table(table))
    assert back == table and back["method"] == "sd"
    assert verify_width({"verify": "tree", "tree_budget": 10**9}) == 1 + MAX_TREE_NODES
    assert verify_width({"verify": "two-level", "draft_len": 3, "two_level_alts": 10**6}) == 1 + 3 * 9
    assert verify_width({"draft_len": "many", "method": ["ar"]}) == 1 + DecodeConfig().draft_len
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_table('method = "sd\n')
