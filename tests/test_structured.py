"""Structured outputs (kstep/structured) on every family that keeps a grammar, with random weights
(the worst case: the model prefers nothing the grammar wants): each output is valid for its spec
(jsonschema validates the JSON), complete (finish_reason "stop") whenever a completion fits, the
forced text costs no pass, batched equals alone with constrained and free requests mixed, and what
cannot be kept is refused by name. The server's side is tests/test_structured_server.py."""
import json
import re
from dataclasses import replace

import jsonschema
import pytest

import kstep
from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.params import GenerationParams
from kstep.random_checkpoint import write_random_checkpoint
from kstep.structured import StructuredSpec
from test_engine import run

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "minLength": 2}}, "required": ["city"]}},
    "required": ["name", "age", "address"], "additionalProperties": False}
SPECS = [StructuredSpec.json_schema(PERSON), StructuredSpec.json_object(), StructuredSpec("regex", r"\d{3}-[a-z]{2,4}"),
         StructuredSpec.choice(["positive", "negative", "neutral"]),
         StructuredSpec("grammar", 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]+/')]
# (family, settings): every decoder that keeps a grammar, the settings that choose another path through it
CASES = [("llama", {}), ("llama", {"temperature": 1.0, "seed": 3}), ("qwen2", {}),
         ("llada", {}), ("llada", {"exact": True}), ("llada", {"cache": "prefix", "threshold": 0.5}),
         ("llada", {"temperature": 0.8, "seed": 1}), ("llada", {"cfg_scale": 0.5, "exact": True}),
         ("llada_moe", {}), ("dream", {}), ("dream", {"exact": True}), ("dream", {"cache": "none"}),
         ("fast_dllm_v2", {}), ("fast_dllm_v2", {"cache": "dual"}), ("fast_dllm_v2", {"exact": True}),
         ("sdar", {}), ("sdar", {"steps": 4, "temperature": 1.0, "seed": 2}), ("llada2_moe", {}),
         ("llada2_moe", {"editing_threshold": 0.05, "max_post_steps": 4}),
         ("llada2_moe", {"editing_threshold": 0.01, "temperature": 1.0, "seed": 6}),
         ("diffusion_gemma", {}), ("diffusion_gemma", {"temperature": 1.0, "seed": 5, "max_denoising_steps": 8}),
         ("nemotron_labs_diffusion", {"mode": "ar"}), ("nemotron_labs_diffusion", {}),
         ("nemotron_labs_diffusion", {"mode": "linear_spec"}),
         ("nemotron_labs_diffusion", {"exact": True, "temperature": 1.0, "seed": 4})]


@pytest.fixture(scope="module")
def models(random_models):
    return random_models


def valid(spec: StructuredSpec, text: str) -> bool:
    """Whether `text` is in the language of `spec`, checked without the grammar engine."""
    if spec.kind == "json":
        try:
            jsonschema.validate(json.loads(text), json.loads(spec.value))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if spec.kind == "choice":
        return text in json.loads(spec.value)
    return re.fullmatch(r"\((\d+\+)*\d+\)", text) is not None  # the grammar above


@pytest.mark.parametrize("family,settings", CASES, ids=[f"{f}-{'-'.join(map(str, s.values())) or 'default'}"
                                                        for f, s in CASES])
def test_every_output_is_valid_and_complete(models, family, settings):
    llm = models(family)
    for spec in SPECS:
        for max_tokens in (96, smallest(llm, spec, **settings)):  # room to spare; just room enough
            [r] = llm.generate("def f(x):", max_tokens=max_tokens, structured=spec, **settings)
            assert r.finish_reason == "stop" and valid(spec, r.text), (spec.kind, max_tokens, r.text)
            assert len(r.token_ids) < max_tokens  # its end-of-sequence token fitted too


def test_a_completion_always_fits_the_room_it_was_admitted_with(models):
    """At the smallest max_tokens admitted, every family still closes the JSON with "stop"."""
    spec = StructuredSpec.json_schema(PERSON)
    for family in ("llama", "llada", "sdar", "dream"):
        llm = models(family)
        with pytest.raises(ValueError, match=r"max_tokens \(\d+\) is too small for the structured: the shortest"):
            llm.generate("x", max_tokens=8, structured=spec)
        least = smallest(llm, spec)
        for temperature in (0, 1.0):
            [r] = llm.generate("x", max_tokens=least, structured=spec, temperature=temperature, seed=7)
            assert r.finish_reason == "stop" and valid(spec, r.text), (family, r.text)


def smallest(llm, spec: StructuredSpec, **settings) -> int:
    """The smallest max_tokens the model admits `spec` with."""
    for max_tokens in range(1, 200):
        try:
            llm.resolve(GenerationParams(max_tokens=max_tokens, structured=spec, **settings))
        except ValueError:
            continue
        return max_tokens
    raise AssertionError("never admitted")


def test_forced_text_costs_no_pass(models):
    """The schema's keys and punctuation are placed without a forward pass: AR jumps forward over
    them, a diffusion canvas takes them at its frontier (the result's figures count them)."""
    spec = StructuredSpec.json_schema(PERSON)
    for family in ("llama", "llada", "fast_dllm_v2"):
        [r] = kstep.LLM.generate(models(family), "x", max_tokens=64, structured=spec)
        forced = r.timings["grammar_forced_tokens"]
        assert forced >= len('{"name": "", "age": , "address": {"city": ""}}') // 4, (family, forced)
        if family == "llama":  # one pass per sampled token, none per forced one
            assert r.nfe == len(r.token_ids) + 1 - forced


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculative_decoding_verifies_drafts_against_the_grammar(tmp_path, draft):
    """Greedy, the drafted output is the plain constrained output (the masked target's argmax); sampled,
    it is valid; the drafts that the grammar refuses are never kept."""
    target = write_random_checkpoint(tmp_path / "t", family="llama", seed=5)
    drafter = "ngram" if draft == "ngram" else write_random_checkpoint(tmp_path / "d", family="llama", seed=9)
    plain, speculative = kstep.load(target), kstep.load(target, draft=drafter)
    for spec in SPECS:
        want = plain.generate("def f(x):", max_tokens=96, structured=spec)[0]
        got = speculative.generate("def f(x):", max_tokens=96, structured=spec, num_draft_tokens=3)[0]
        assert got.token_ids == want.token_ids and got.finish_reason == "stop", spec.kind
        [sampled] = speculative.generate("x", max_tokens=96, structured=spec, num_draft_tokens=3, temperature=1.0,
                                         seed=2)
        assert sampled.finish_reason == "stop" and valid(spec, sampled.text), (spec.kind, sampled.text)


@pytest.mark.parametrize("family", ["llama", "llada", "llada_moe", "dream", "fast_dllm_v2", "sdar", "llada2_moe",
                                    "diffusion_gemma", "nemotron_labs_diffusion"])
def test_batched_equals_alone_with_constrained_and_free_requests_mixed(models, family):
    """One engine step packs constrained and unconstrained requests of a model: each gets what it
    gets alone (greedy), every family."""
    llm = models(family)
    engine = Engine(llm, max_batch_size=8)
    requests, alone = [], {}
    for i, (prompt, spec) in enumerate([("def f(x):", SPECS[0]), ("import os", None), ("x", SPECS[2]),
                                        ("class A:", None), ("y =", SPECS[3])]):
        params = llm.resolve(GenerationParams(max_tokens=64, structured=spec))
        request = Request([llm.encode_prompt(prompt)], params)
        requests.append((i % 2, request))
        alone[request.request_id] = llm.generate(llm.encode_prompt(prompt), params)[0]
    arrivals: dict[int, list[Request]] = {}
    for join, request in requests:
        arrivals.setdefault(join, []).append(request)
    run(engine, arrivals)
    for _, request in requests:
        want = alone[request.request_id]
        assert llm.cut_at_stop(request.output_ids[0]) == (want.token_ids, want.finish_reason), family


def test_rows_of_one_request_each_keep_their_grammar(models):
    llm = models("llada")
    results = llm.generate(["a", "def g(y):", "import re"], max_tokens=40, structured=SPECS[0], temperature=1.0,
                           seed=11)
    assert all(r.finish_reason == "stop" and valid(SPECS[0], r.text) for r in results)
    alone = [llm.generate(p, max_tokens=40, structured=SPECS[0])[0].text for p in ("a", "def g(y):")]
    assert [r.text for r in llm.generate(["a", "def g(y):"], max_tokens=40, structured=SPECS[0])] == alone


@pytest.mark.parametrize("family,settings,says", [
    ("llada", {"draft": "self"}, "not kept with draft 'self'"),
    ("sdar", {"draft": "self"}, "not kept with draft 'self'"),
    ("llama", {"ignore_eos": True}, "ignore_eos: a structured output"),
])
def test_what_cannot_keep_a_grammar_is_refused_by_name(models, family, settings, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        models(family).generate("x", max_tokens=32, structured=SPECS[0], **settings)


def test_bad_specs_are_refused_naming_their_field(models):
    llm = models("llama")
    for spec, says in [(StructuredSpec("regex", "(", "--regex"), "--regex: the regex cannot be enforced"),
                       (StructuredSpec("grammar", "start: undefined_rule", "g"), "g: the grammar cannot be enforced"),
                       (StructuredSpec.json_schema({"type": "string", "pattern": "(["}, "s"), "s: the JSON schema")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            llm.generate("x", max_tokens=16, structured=spec)
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredSpec.json_schema("{nope")
    with pytest.raises(ValueError, match="suffix: infilling with a structured output"):
        models("llada").generate("x", max_tokens=16, structured=SPECS[1], suffix=" y")
    assert llm.generate("x", max_tokens=8)[0].finish_reason in ("stop", "length")  # and the model goes on


def test_a_grammar_compiles_once_per_model(models):
    llm = models("llama")
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"k": {"type": "integer"}}})
    llm.generate("x", max_tokens=16, structured=spec)
    again = StructuredSpec.json_schema(json.dumps({"type": "object", "properties": {"k": {"type": "integer"}}}, indent=2))
    assert llm.grammar.compile(again) is llm.grammar.compile(spec)  # equal schemas, one compiled grammar


def test_the_cli_flags_ask_for_each_kind(tmp_path, capsys):
    from kstep.cli import main
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(PERSON))
    for flags, spec in [(["--json-schema", str(schema)], SPECS[0]), (["--regex", SPECS[2].value], SPECS[2]),
                        (["--choice", "positive,negative,neutral"], SPECS[3])]:
        assert main(["generate", "x", "--model", "default-ar", "--max-tokens", "48", "--json", *flags]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["finish_reason"] == "stop" and valid(spec, result["text"]), result
    assert main(["generate", "x", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "--json-schema" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one structured output at a time
        main(["generate", "x", "--regex", "a", "--choice", "a,b"])


def test_params_refuse_a_spec_that_is_not_one():
    with pytest.raises(ValueError, match="structured must be a StructuredSpec"):
        replace(GenerationParams(), structured={"type": "object"})


@pytest.mark.parametrize("family", ["llama", "llada", "sdar", "diffusion_gemma"])
def test_logit_bias_moves_the_tokens_it_names(models, family):
    """OpenAI's logit_bias: -100 on the two tokens a greedy run starts with keeps them out of it, +100
    on a token makes every position take it."""
    llm = models(family)
    [plain] = llm.generate("def f(x):", max_tokens=16, ignore_eos=True)
    banned = tuple((t, -100.0) for t in dict.fromkeys(plain.token_ids[:2]))
    [biased] = llm.generate("def f(x):", max_tokens=16, ignore_eos=True, logit_bias=banned)
    assert not {t for t, _ in banned} & set(biased.token_ids), (plain.token_ids, biased.token_ids)
    [forced] = llm.generate("def f(x):", max_tokens=8, ignore_eos=True, logit_bias=((42, 100.0),))
    assert forced.token_ids == [42] * 8
    with pytest.raises(ValueError, match="logit_bias: token id 999999 is outside the vocabulary"):
        llm.generate("x", max_tokens=4, logit_bias=((999999, 1.0),))
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be >= -100 and <= 100"):
        GenerationParams(logit_bias=((3, 101.0),))
