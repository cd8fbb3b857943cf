"""Secrets and trust: header values and pasted keys are written nowhere, nothing is unpickled,
run names stay under runs/, and the vLLM servers specdraft starts stay on 127.0.0.1.

Everything here runs in-process (`main(argv)`) in a scratch folder and stops before any model work: a
refusal must come before anything is written, so the test looks at the files a command left behind.
"""

from __future__ import annotations

import ast
import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_bad_input import assert_one_error_line, run_main

from specdraft.config import ConfigError, apply_sets, load_recipe
from specdraft.data.client import Auth
from specdraft.run import RunFolder

ROOT = Path(__file__).resolve().parents[1]
SECRET = "sk-specdraft-secret-7f3a9c"
PASTED = "abcDEF123xyz"  # a key that looks like a variable's name
OFF = "http://127.0.0.1:9"  # nothing listens: every command here must stop before asking it


@pytest.fixture
def place(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for name in ("OPENAI_API_KEY", "VLLM_KEY", "HEADER_TOKEN", PASTED):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def one_error_line(argv: list[str]) -> str:
    return assert_one_error_line(*run_main(argv))


def files_holding(folder: Path, text: str) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def recipe_file(place: Path, body: str) -> str:
    path = place / "r.toml"
    path.write_text(body)
    return str(path)


# --- header values: only ${NAME}, whatever their source ----------------------------------------------------


@pytest.mark.parametrize("source", ["--set", "--headers", "recipe"])
def test_a_literal_header_value_is_refused_before_anything_is_written(place, source):
    if source == "recipe":
        argv = ["gen", "--recipe", recipe_file(place, f'name = "h"\n[gen]\nheaders = {{"X-Token" = "{SECRET}"}}\n')]
    else:
        value = json.dumps({"Authorization": f"Bearer {SECRET}"})
        argv = [
            "gen",
            "--run",
            "run",
            *(["--set", f"gen.headers={value}"] if source == "--set" else ["--headers", value]),
        ]
    line = one_error_line([*argv, "--endpoint", OFF])
    assert "gen.headers" in line and "${NAME}" in line and SECRET not in line
    assert not (place / "runs").exists() and not (place / "run").exists()


def test_header_references_are_kept_and_read_back_from_the_manifest(place, monkeypatch):
    """`${NAME}` holds no secret: the manifest keeps it as given, and a later command reading the recipe back
    from there sends the variable's value."""
    headers = json.dumps({"X-Token": "${HEADER_TOKEN}"})
    # render on a run without gen: refused as out of order, after the run folder recorded its recipe
    line = one_error_line(["render", "--run", "run", "--set", f"gen.headers={headers}"])
    assert "stage 'gen' is missing" in line
    assert json.loads((place / "run" / "manifest.json").read_text())["recipe"]["gen"]["headers"] == {
        "X-Token": "${HEADER_TOKEN}"
    }
    recipe = RunFolder(place / "run").recipe()
    monkeypatch.setenv("HEADER_TOKEN", SECRET)
    assert Auth.from_env(recipe.gen.api_key_env, recipe.gen.headers).headers == {"X-Token": SECRET}
    assert files_holding(place, SECRET) == []


def test_a_manifest_holding_a_literal_header_value_is_refused_by_name(place):
    """A run recorded before values were checked: read back, it is refused naming the manifest, not the value."""
    code, _ = run_main(["render", "--run", "run"])
    manifest = json.loads((place / "run" / "manifest.json").read_text())
    manifest["recipe"]["gen"]["headers"] = {"X-Token": SECRET}
    (place / "run" / "manifest.json").write_text(json.dumps(manifest))
    line = one_error_line(["render", "--run", "run"])
    assert "manifest.json" in line and "gen.headers['X-Token']" in line and SECRET not in line


def test_a_password_in_an_endpoint_url_is_refused(place):
    url = f"http://user:{SECRET}@127.0.0.1:9"
    line = one_error_line(["gen", "--run", "run", "--endpoint", url])
    assert "user or password" in line and SECRET not in line
    assert not (place / "run").exists()
    line = one_error_line(["render", "--run", "run", "--verify-endpoint", url])
    assert "user or password" in line and SECRET not in line
    line = one_error_line(["bench", "--run", "run", "--endpoint", url])
    assert "user or password" in line and SECRET not in line
    assert not (place / "run").exists()


# --- a key pasted where its variable's name belongs ------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["gen", "--endpoint", OFF],
        ["render", "--verify-endpoint", OFF],
        ["bench", "--endpoint", OFF],
    ],
)
@pytest.mark.parametrize("given", ["flag", "recipe"])
def test_a_key_variable_that_is_not_set_is_refused_before_anything_is_written(place, command, given):
    """A key that looks like a name passes the name check; unset as a variable, it is refused where the key is
    about to be used, before the recipe naming it is recorded, and it is not repeated in the error."""
    if given == "flag":
        argv = [*command, "--run", "run", "--set", f"gen.api_key_env={PASTED}"]
    else:
        argv = [
            *command,
            "--run",
            "run",
            "--recipe",
            recipe_file(place, f'name = "k"\n[gen]\napi_key_env = "{PASTED}"\n'),
        ]
    line = one_error_line(argv)
    assert "gen.api_key_env" in line and "not set" in line and PASTED not in line
    assert not (place / "run").exists()


def test_the_default_variable_unset_and_an_empty_name_send_no_key(place):
    """Local servers need no key: $OPENAI_API_KEY unset (or api_key_env = "") is no refusal; render gets past
    the key check and stops where a render without gen stops."""
    assert "stage 'gen' is missing" in one_error_line(["render", "--run", "run", "--verify-endpoint", OFF])
    assert "stage 'gen' is missing" in one_error_line(
        ["render", "--run", "run2", "--verify-endpoint", OFF, "--set", "gen.api_key_env="]
    )
    assert Auth.from_env("OPENAI_API_KEY", {}, environ={}).headers == {}
    assert Auth.from_env("", {}, environ={"OPENAI_API_KEY": SECRET}).headers == {}
    with pytest.raises(ConfigError, match="not set"):
        Auth.from_env("VLLM_KEY", {}, environ={})
    assert Auth.from_env("VLLM_KEY", {}, environ={"VLLM_KEY": SECRET}).headers == {"Authorization": f"Bearer {SECRET}"}


def test_a_run_whose_gen_used_a_key_trains_without_it(place, monkeypatch):
    """train never sends the key, so a run recorded with gen.api_key_env = VLLM_KEY is not refused in a shell
    without VLLM_KEY: train gets past the recipe to its own check (no hidden states here)."""
    monkeypatch.setenv("VLLM_KEY", SECRET)
    assert "stage 'gen' is missing" in one_error_line(["render", "--run", "run", "--set", "gen.api_key_env=VLLM_KEY"])
    monkeypatch.delenv("VLLM_KEY")
    assert "stage 'extract' is missing" in one_error_line(["train", "--run", "run"])
    assert RunFolder(place / "run").recipe().gen.api_key_env == "VLLM_KEY"
    assert files_holding(place, SECRET) == []


# --- nothing through pickle ----------------------------------------------------------------------------------

# What would read a pickle: these modules imported, or these functions called.
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
PICKLING_CALLS = {
    "torch.load",
    "torch.jit.load",
    "torch.hub.load",
    "torch.serialization.load",
    "numpy.load",
    "np.load",
    "pandas.read_pickle",
    "pd.read_pickle",
}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def pickle_readers(path: Path) -> list[str]:
    """Where a file imports a pickling module or names a function that unpickles (code, not strings)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if (node.module or "").split(".")[0] in PICKLING_MODULES else []
            names += [a.name for a in node.names if f"{node.module}.{a.name}" in PICKLING_CALLS]
        elif isinstance(node, ast.Attribute) and _dotted(node) in PICKLING_CALLS:
            names = [_dotted(node)]
        found += [f"{path}:{node.lineno}: {n}" for n in names]
    return found


def test_no_code_reads_a_pickle():
    """The package, bench/ and scripts/ never import pickle or call torch.load (a drafter's .bin is refused
    with the command that converts it; that command is a string, which is why this reads the syntax tree)."""
    files = [*ROOT.glob("specdraft/**/*.py"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("scripts/**/*.py")]
    assert len(files) > 40
    assert [hit for f in files for hit in pickle_readers(f)] == []


def test_the_pickle_check_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch, joblib\nfrom pickle import loads\nfrom torch import load\n"
        "x = torch.load('a', weights_only=True)\ny = 'torch.load(a)'  # a string: fine\n"
    )
    assert [hit.split(": ")[1] for hit in pickle_readers(bad)] == ["joblib", "pickle", "load", "torch.load"]


def _tiny_bin_folder(out: Path, tensors: dict | None = None) -> dict:
    """A vLLM-format drafter folder whose weights are a pytorch_model.bin (tensors, or any pickled object)."""
    from test_formats import export, tiny_drafter

    export("vllm", tiny_drafter(), out)
    state = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    torch.save(state if tensors is None else tensors, out / "pytorch_model.bin")
    return state


class _Planted:
    """Unpickling this creates the file `path`: what a pickle from a stranger could do."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_bin_drafter_folder_is_refused_unread_with_the_command_that_converts_it(place):
    marker = place / "unpickled"
    _tiny_bin_folder(place / "evil", {"x": _Planted(marker)})
    state = _tiny_bin_folder(place / "drafter")
    for folder in ("evil", "drafter"):
        line = one_error_line(["import", folder, "--out", f"out-{folder}"])
        assert "pytorch_model" in line and "pickle" in line and "weights_only=False" not in line
        assert not (place / f"out-{folder}").exists()
    assert not marker.exists()
    # The command it gives (torch + safetensors alone, run where the file is trusted) converts the folder.
    command = line.split("rerun: ", 1)[1]
    python, flag, code = shlex.split(command)
    assert (python, flag) == ("python", "-c")
    exec(code, {})  # noqa: S102 - the command's own code, in-process: no second interpreter to start
    back = load_file(str(place / "drafter" / "model.safetensors"))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    from specdraft.methods.eagle3.formats import read_published

    read_published(place / "drafter")  # now read, through safetensors


def test_a_bin_target_folder_is_refused_before_transformers_opens_it(place, target):
    folder = place / "bin-target"
    shutil.copytree(target.path, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    (folder / "pytorch_model.bin").write_bytes(b"never opened")
    from specdraft.targets import Target

    with pytest.raises(ValueError, match="pytorch_model.*pickle.*python -c"):
        Target(str(folder)).load_model("float32")


# --- run names stay under runs/ --------------------------------------------------------------------------------

BAD_NAMES = ["../../escaped", "/tmp/escaped-abs", "..", ".", "a/b", "a\\b", ".hidden", "", "-x", "a b"]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("given", ["recipe", "--set"])
def test_a_run_name_that_would_leave_runs_is_refused(place, monkeypatch, name, given):
    if given == "recipe":
        argv = ["render", "--recipe", recipe_file(place, f"name = {json.dumps(name)}\n")]
    else:
        argv = ["render", "--set", f"name={name}"]
    (place / "work").mkdir()
    monkeypatch.chdir(place / "work")  # runs/ would be made here: ../../escaped is then outside `place`
    line = one_error_line(argv)
    assert "name" in line and "not a run name" in line
    assert sorted(p.name for p in place.rglob("*")) == (["r.toml", "work"] if given == "recipe" else ["work"])


def test_a_plain_name_and_an_explicit_run_folder_anywhere_are_kept(place):
    assert "stage 'gen' is missing" in one_error_line(["render", "--set", "name=kimi-k2.5_v2"])
    assert "stage 'gen' is missing" in one_error_line(["render", "--recipe", recipe_file(place, 'name = "my-run.1"\n')])
    assert (place / "runs" / "my-run.1" / "manifest.json").exists()
    # --run DIR is the user's own choice of folder, wherever it is
    assert "stage 'gen' is missing" in one_error_line(["render", "--run", str(place / "elsewhere")])
    assert (place / "elsewhere" / "manifest.json").exists()


# --- servers stay on 127.0.0.1 --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        "--host,0.0.0.0",
        "--host=0.0.0.0",
        "--hos,0.0.0.0",
        "--port=8000",
        "--por,1",
        "--uds,/tmp/s",
        "--config,serve.yaml",
        "--api-key," + SECRET,
        "--api-key=" + SECRET,
        "--api_key=x",
        "--data-parallel-address,10.0.0.1",
        "--master-addr=10.0.0.1",
    ],
)
def test_vllm_args_that_would_move_the_server_are_refused(place, args):
    line = one_error_line(
        ["extract", "--run", "run", "--set", "extract.backend=vllm", "--set", f"extract.vllm_args={args}"]
    )
    assert "extract.vllm_args" in line and "not passed to vLLM" in line and SECRET not in line
    assert not (place / "run").exists()
    with pytest.raises(ConfigError, match="not passed to vLLM"):
        load_recipe(recipe_file(place, f'[extract]\nvllm_args = {json.dumps(args.split(","))}\n'))


def test_engines_refuse_them_too_and_pass_the_rest():
    from specdraft.engines import VllmServer, serve_args

    with pytest.raises(ValueError, match="127.0.0.1"):
        serve_args("m", extra=["--host", "0.0.0.0"])
    with pytest.raises(ValueError, match="127.0.0.1"):
        VllmServer("m", log_path=Path("unused.log"), extra=["--hos=0.0.0.0"])
    fine = ["--tensor-parallel-size", "8", "--trust-remote-code", "--pooler-config", "{}", "--enforce-eager"]
    assert serve_args("m", extra=fine)[-len(fine) :] == fine
    recipe = apply_sets(load_recipe("kimi-k2.5-8gpu"), ["extract.vllm_args=--tensor-parallel-size,8"])
    assert recipe.extract.vllm_args == ["--tensor-parallel-size", "8"]
