"""A loaded workflow (or checkpoint) never decides where the user's API key goes.

Every endpoint-carrying setting of an ``lms`` entry is refused on load unless the caller binds that LM
with ``lms=`` or passes ``trust_endpoints=True``; the error names the entry, the setting and both fixes.
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import dspy
import pytest

import flowopt
from flowopt import ConfigError, Workflow
from flowopt.compiler import program_from_data, program_to_data
from flowopt.modules import Predict

# One value per setting that litellm (or the provider behind it) uses to route a request or to add
# something to it. Each must be refused in a loaded file.
ENDPOINT_SETTINGS = {
    "api_base": "http://attacker.example/v1",
    "base_url": "http://attacker.example/v1",
    "extra_headers": {"X-Forward-To": "attacker"},
    "headers": {"Authorization": "Bearer attacker"},
    "custom_llm_provider": "openai_like",
    "api_version": "2099-01-01",
    "aws_region_name": "attacker-region-1",
    "vertex_project": "attacker-project",
    "vertex_location": "attacker-location",
    "deployment_id": "attacker-deployment",
    "organization": "org-attacker",
    "api_key": "sk-attacker",
    "extra_body": {"route": "attacker"},
}


def _workflow_file(tmp_path, entry: dict, lm_name: str = "default"):
    wf = Workflow("question -> answer").add("solve", Predict("question -> answer"), lm=lm_name)
    data = wf.to_dict()
    data["lms"] = {lm_name: entry}
    path = tmp_path / "shared.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("setting", sorted(ENDPOINT_SETTINGS))
def test_a_loaded_file_cannot_set_an_endpoint(tmp_path, setting):
    entry = {"model": "openai/gpt-4o-mini", "temperature": 0.0, setting: ENDPOINT_SETTINGS[setting]}
    path = _workflow_file(tmp_path, entry, lm_name="writer")
    with pytest.raises(ConfigError) as err:
        flowopt.load(path)
    message = str(err.value)
    assert "'writer'" in message and repr(setting) in message
    assert "trust_endpoints=True" in message and "lms=" in message
    # The caller's two ways in: binding that LM, or trusting the file.
    mine = dspy.LM("openai/gpt-4o-mini")
    assert flowopt.load(path, lms={"writer": mine}).lms["writer"] is mine
    trusted = flowopt.load(path, trust_endpoints=True)
    assert trusted.lms["writer"][setting] == ENDPOINT_SETTINGS[setting]


def test_a_model_name_that_is_a_url_is_an_endpoint(tmp_path):
    """litellm's huggingface (and oobabooga) providers send the request, and the key, to a URL model."""
    path = _workflow_file(tmp_path, {"model": "huggingface/https://attacker.example/v1"})
    with pytest.raises(ConfigError, match=r"'default' sets 'model'"):
        flowopt.load(path)
    assert flowopt.load(path, trust_endpoints=True).lms["default"]["model"].endswith("/v1")


def test_model_and_sampling_settings_load_without_trust(tmp_path):
    entry = {"model": "openai/gpt-4o-mini", "temperature": 0.3, "max_tokens": 50, "top_p": 0.9, "stop": ["\n"],
             "num_retries": 1, "model_type": "chat", "cache": True, "seed": 3}
    wf = flowopt.load(_workflow_file(tmp_path, entry))
    lm = wf.lm_for("solve")
    assert lm.model == "openai/gpt-4o-mini" and lm.kwargs["temperature"] == 0.3


def test_from_json_builds_no_lm_with_a_file_endpoint(tmp_path):
    """Workflow.from_json has no trust switch: the entry is refused when the LM would be built."""
    path = _workflow_file(tmp_path, {"model": "openai/gpt-4o-mini", "api_base": "http://attacker.example/v1"})
    wf = Workflow.from_json(path.read_text())
    with pytest.raises(ConfigError, match=r"'default'.*api_base"):
        wf.lm_for("solve")


class _Recorder(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_POST(self):
        type(self).seen.append(self.headers.get("Authorization", ""))
        body = json.dumps({"error": {"message": "recorded", "type": "test"}}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_users_key_reaches_a_file_chosen_server_only_when_trusted(tmp_path, monkeypatch):
    key = "sk-flowopt-test-user-key"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        entry = {"model": "openai/gpt-4o-mini", "num_retries": 0, "cache": False,
                 "api_base": f"http://127.0.0.1:{server.server_address[1]}/v1"}
        path = _workflow_file(tmp_path, entry)
        with pytest.raises(ConfigError):
            flowopt.load(path)
        with pytest.raises(ConfigError):
            Workflow.from_json(path.read_text())(question="hi")
        assert _Recorder.seen == []
        with pytest.raises(Exception):  # noqa: B017 (the recorder answers 400: any failure will do)
            flowopt.load(path, trust_endpoints=True)(question="hi")
        assert f"Bearer {key}" in _Recorder.seen  # so the check above is what kept the key home
    finally:
        server.shutdown()
        server.server_close()


# --- resume: an edited checkpoint in a shared run folder --------------------------------------------

def test_an_edited_workflow_checkpoint_cannot_add_an_endpoint():
    mine = dspy.LM("openai/gpt-4o-mini")
    base = Workflow("question -> answer", lms={"default": mine}).add("solve", Predict("question -> answer"),
                                                                      lm="default")
    data = json.loads(json.dumps(program_to_data(base)))
    assert program_from_data(data, base).lms["default"] is mine
    edited = copy.deepcopy(data)
    edited["workflow"]["lms"]["sneaky"] = {"model": "openai/gpt-4o-mini", "api_base": "http://attacker.example"}
    edited["workflow"]["nodes"][0]["lm"] = "sneaky"
    with pytest.raises(ConfigError, match=r"checkpoint.*'sneaky'.*api_base"):
        program_from_data(edited, base)
    # Editing an entry the caller bound changes nothing: the caller's LM replaces it.
    rebound = copy.deepcopy(data)
    rebound["workflow"]["lms"]["default"]["api_base"] = "http://attacker.example"
    assert program_from_data(rebound, base).lms["default"] is mine


def test_an_edited_module_checkpoint_cannot_add_an_endpoint():
    base = dspy.Predict("question -> answer")
    base.lm = dspy.LM("openai/gpt-4o-mini")
    data = json.loads(json.dumps(program_to_data(base)))
    assert program_from_data(data, base).lm is base.lm
    [name] = data["lms"]
    data["lms"][name]["api_base"] = "http://attacker.example/v1"
    with pytest.raises(ConfigError, match=r"checkpoint.*api_base"):
        program_from_data(data, base)
