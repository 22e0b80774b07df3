"""``attnscale variance`` and ``attnscale saturation`` end to end (in-process via
``attnscale.cli.main``): JSON and tables, and every bad input as one line with exit 2."""

from __future__ import annotations

import json
import math
import re

import pytest

from attnscale.measure.montecarlo import saturation

SAT_KEYS = {"mechanism", "d_k", "n", "trials", "seed", "max_weight_mean", "max_weight_se",
            "entropy_mean", "entropy_se", "jacobian_fro_mean", "jacobian_fro_se",
            "logit_std_mean"}
VAR_KEYS = {"d_k", "pairs", "seed", "std", "predicted", "rel_error", "std_ci95"}
SAT_ARGS = ("saturation", "--dk", "4,64", "--n", "32", "--trials", "20", "--seed", "0")
VAR_ARGS = ("variance", "--dk", "4,16", "--pairs", "1000", "--seed", "0")


def _one_json_object(out: str) -> dict:
    """``out`` is exactly one JSON object (json.loads rejects trailing data) plus a newline."""
    assert out.endswith("\n") and out.count("\n") == 1, out[-200:]
    obj = json.loads(out)
    assert isinstance(obj, dict) and list(obj) == ["rows"]
    return obj


# ---------------------------------------------------------------------------------------------
# --json and tables


def test_variance_json(cli):
    code, out, err = cli(*VAR_ARGS, "--json")
    assert code == 0 and err == ""            # no progress bar when stderr is not a terminal
    rows = _one_json_object(out)["rows"]
    assert [r["d_k"] for r in rows] == [4, 16]
    for r in rows:
        assert VAR_KEYS <= set(r)
        assert (r["pairs"], r["seed"]) == (1000, 0)
        assert r["predicted"] == math.sqrt(r["d_k"])
        ci = r["std_ci95"]
        assert isinstance(ci, list) and len(ci) == 2
        assert all(isinstance(x, float) for x in ci) and ci[0] < r["std"] < ci[1]


def test_variance_ci_never_goes_below_zero(cli):
    code, out, _ = cli("variance", "--dk", "4", "--pairs", "2", "--json")
    assert code == 0
    lo, hi = _one_json_object(out)["rows"][0]["std_ci95"]
    assert 0.0 < lo < hi


def test_saturation_json(cli):
    code, out, err = cli(*SAT_ARGS, "--json")
    assert code == 0 and err == ""
    rows = _one_json_object(out)["rows"]
    assert [(r["mechanism"], r["d_k"]) for r in rows] == [
        ("scaled", 4), ("unscaled", 4), ("scaled", 64), ("unscaled", 64)]
    for r in rows:
        assert SAT_KEYS <= set(r)
        assert (r["n"], r["trials"], r["seed"]) == (32, 20, 0)
    # The CLI is a thin layer: its rows are the API's rows.
    assert rows == saturation([4, 64], 32, 20, 0)


def test_saturation_json_mechanism_subset(cli):
    code, out, _ = cli(*SAT_ARGS, "--mechanisms", "unscaled", "--json")
    assert code == 0
    assert {r["mechanism"] for r in _one_json_object(out)["rows"]} == {"unscaled"}


def test_saturation_takes_a_list_of_n(cli):
    code, out, _ = cli("saturation", "--dk", "64", "--n", "16,64,256", "--trials", "10",
                       "--mechanisms", "scaled", "--json")
    assert code == 0
    rows = _one_json_object(out)["rows"]
    assert [(r["d_k"], r["n"]) for r in rows] == [(64, 16), (64, 64), (64, 256)]
    assert rows == saturation([64], [16, 64, 256], 10, 0, ["scaled"])


@pytest.mark.parametrize("args, columns, n_rows", [
    (SAT_ARGS, ["mechanism", "d_k", "n", "max_weight_mean", "entropy_mean", "jacobian_fro_mean"],
     4),
    (VAR_ARGS, ["d_k", "pairs", "std", "predicted", "std_ci95"], 2),
])
def test_plain_output_is_a_table(cli, args, columns, n_rows):
    code, out, _ = cli(*args)
    assert code == 0
    lines = out.rstrip("\n").splitlines()
    assert len(lines) == 2 + n_rows
    header = lines[0].split()
    for col in columns:
        assert col in header
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert not out.lstrip().startswith("{")
    for line in lines[2:]:
        assert len(line) == len(lines[0])          # aligned columns


@pytest.mark.parametrize("args", [SAT_ARGS, VAR_ARGS])
def test_same_seed_gives_identical_json(cli, args):
    first = cli(*args, "--json")
    second = cli(*args, "--json")
    assert first[0] == 0 and first == second
    other = cli(*[a if a != "0" else "1" for a in args], "--json")   # --seed 1
    assert other[0] == 0 and other[1] != first[1]


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one line naming the parameter, no traceback


BAD_INPUTS = [
    (("variance", "--dk", "0"), r"--dk"),
    (("variance", "--dk", "-4"), r"--dk"),
    (("variance", "--pairs", "1"), r"pairs"),
    (("variance", "--seed", "-1"), r"seed"),
    (("saturation", "--dk", "0"), r"--dk"),
    (("saturation", "--dk", "-4"), r"--dk"),
    (("saturation", "--dk", "4,,8"), r"--dk"),
    (("saturation", "--dk", "abc"), r"--dk"),
    (("saturation", "--dk", ""), r"--dk"),
    (("saturation", "--n", "0"), r"(--|\s)n\b"),
    (("saturation", "--n", "abc"), r"--n\b"),
    (("saturation", "--n", "16,"), r"--n\b"),
    (("saturation", "--trials", "1"), r"trials"),
    (("saturation", "--seed", "-1"), r"seed"),
    (("saturation", "--mechanisms", "scaled,unscled"), r"mechanism.*Did you mean: unscaled\?"),
    (("saturation", "--mechanisms", "scaled,"), r"--mechanisms"),
    (("saturation", "--mechanisms", "init-reparam"), r"mechanism 'init-reparam'"),
    # A repeated entry in any list option names the option and the value.
    (("variance", "--dk", "4,16,4"), r"--dk lists 4 more than once"),
    (("saturation", "--dk", "4,4"), r"--dk lists 4 more than once"),
    (("saturation", "--n", "16,64,16"), r"--n lists 16 more than once"),
    (("saturation", "--mechanisms", "scaled,scaled,scaled,scaled"),
     r"--mechanisms lists 'scaled' more than once"),
    (("saturation", "--mechanisms", "unscaled,scaled,unscaled"),
     r"--mechanisms lists 'unscaled' more than once"),
    # Sizes that cannot fit in memory or would run for days are refused up front.
    (("saturation", "--dk", "4", "--n", "100000000000"),
     r"n=100000000000 .*would need about [\d,.]+ GiB"),
    (("saturation", "--dk", "4", "--n", "16,100000000000"), r"n=100000000000 .*GiB"),
    (("variance", "--dk", "4", "--pairs", "99999999999999"), r"pairs=99999999999999 .*days"),
    (("saturation", "--dk", "4", "--trials", "100000000000000"), r"trials=100000000000000 .*days"),
]


@pytest.mark.parametrize("argv, pattern", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(cli, argv, pattern):
    code, out, err = cli(*argv)
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert err.startswith(f"attnscale {argv[0]}: error: ")
    assert re.search(pattern, err), err
