"""Several models in one `kstep serve`: each its own engine and decoding defaults, picked by the
request's `model`; results equal the models alone; metrics carry a `model` label."""
import asyncio

import httpx
import openai
import pytest
from test_bad_input import assert_clean_error, run_cli
from test_server import client, metric

import kstep
from kstep.bench.server_process import running_server
from kstep.server.model_specs import parse_model_spec

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "for i in range(10):", "x = ["]


@pytest.fixture(scope="module")
def pair_server(llada_path, llama_path, tmp_path_factory):
    """The tiny LLaDA twice (its default decoding, and `exact=true` as this model's own default) and the
    tiny LLaMA with the n-gram drafter."""
    with running_server(f"diff={llada_path}", "--model", f"diff-exact={llada_path}:exact=true",
                        "--model", f"ar={llama_path}:draft=ngram", "--max-batch-size", "4",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


def test_models_lists_every_served_model(pair_server):
    data = client(pair_server).models.list().data
    assert [m.id for m in data] == ["diff", "diff-exact", "ar"]
    assert [m.model_extra["kind"] for m in data] == ["diffusion", "diffusion", "autoregressive"]
    health = httpx.get(pair_server + "/health").json()
    assert set(health["models"]) == {"diff", "diff-exact", "ar"}


def test_each_model_answers_as_it_would_alone(pair_server, llada_path, llama_path):
    c = client(pair_server)
    diffusion, ar = kstep.load(llada_path), kstep.load(llama_path, draft="ngram")
    for prompt in PROMPTS[:2]:
        got = {name: c.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
               for name in ("diff", "diff-exact", "ar")}
        assert got["diff"].choices[0].text == diffusion.generate(prompt, max_tokens=16)[0].text
        exact = diffusion.generate(prompt, max_tokens=16, exact=True)[0]
        assert got["diff-exact"].choices[0].text == exact.text and got["diff-exact"].usage.model_extra["nfe"] == 16
        assert got["ar"].choices[0].text == ar.generate(prompt, max_tokens=16)[0].text
    # a request's own field overrides its model's default
    out = c.completions.create(model="diff-exact", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                               extra_body={"steps": 8})
    assert out.usage.model_extra["nfe"] == 8


def test_concurrent_requests_to_both_models(pair_server):
    c = client(pair_server)
    alone = {(name, p): c.completions.create(model=name, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for name in ("diff", "ar") for p in PROMPTS}

    async def together():
        ac = openai.AsyncOpenAI(base_url=pair_server + "/v1", api_key="unused", max_retries=0)
        jobs = [ac.completions.create(model=name, prompt=p, max_tokens=12, temperature=0)
                for p in PROMPTS for name in ("diff", "ar")]
        outs = await asyncio.gather(*jobs)
        return {(o.model, p): o.choices[0].text for o, (p, _) in zip(outs, [(p, n) for p in PROMPTS
                                                                           for n in ("diff", "ar")])}
    assert asyncio.run(together()) == alone


def test_unknown_model_is_a_404_naming_the_served_ones(pair_server):
    with pytest.raises(openai.NotFoundError) as e:
        client(pair_server).completions.create(model="nope", prompt="x", max_tokens=4)
    assert "'diff', 'diff-exact', 'ar'" in str(e.value)


def test_metrics_carry_the_model_label(pair_server):
    c = client(pair_server)
    c.completions.create(model="ar", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    c.completions.create(model="diff", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    for name in ("ar", "diff"):
        assert metric(pair_server, "kstep_requests_total", f'model="{name}",status="200"') > 0
        assert metric(pair_server, "kstep_forward_passes_total", f'model="{name}"') > 0
    with pytest.raises(openai.BadRequestError):  # a bad request to a served model is counted as that model's
        c.completions.create(model="ar", prompt=PROMPTS[0], max_tokens=4, extra_body={"cache": "dual"})
    assert metric(pair_server, "kstep_requests_total", 'model="ar",status="400"') >= 1


def test_model_specs_parse_names_options_and_values():
    spec = parse_model_spec("fast=kstep/bundled/default:token-healing=false,threshold=0.8,draft=ngram,quantize=int8")
    assert (spec.name, spec.model, spec.draft, spec.quantize) == ("fast", "kstep/bundled/default", "ngram", "int8")
    assert spec.defaults == {"token_healing": False, "threshold": 0.8}
    assert parse_model_spec("default-ar") == parse_model_spec("default-ar=default-ar")
    for bad, needle in [("x:bogus=1", "unknown option 'bogus'"), ("x:exact=yes", "true or false"),
                        ("x:threshold=2", "threshold"), ("x:quantize=int3", "int8, int4"), ("=x", "NAME=MODEL"),
                        ("x:steps", "KEY=VALUE"), ("x:exact=true,threshold=0.8", "exact")]:
        with pytest.raises(ValueError, match=needle):
            parse_model_spec(bad)


@pytest.mark.parametrize("args,needles", [
    (["--model", "a=default", "--model", "a=default-ar"], ["'a'", "NAME=MODEL"]),
    (["--model", "default", "--model", "default-ar", "--served-model-name", "x"], ["--served-model-name"]),
    (["--model", "default:bogus=1"], ["unknown option 'bogus'"]),
    # each spec is checked before any model loads or a line is printed (one line on stderr)
    (["--model", "default", "--model", "twin=default-ar:tp=3"], ["--model 'twin=default-ar:tp=3'",
                                                                  "tensor_parallel_size 3"]),
    (["--model", "default", "--model", "ar=default-ar:threshold=0.5"], ["'ar=default-ar:threshold=0.5'",
                                                                         "threshold does not apply"]),
    (["--model", "default-ar", "--model", "d=default:draft=ngram"], ["'d=default:draft=ngram'", "draft 'ngram'"]),
    (["--model", "default", "--model", "x=nowhere/at/all"], ["'x=nowhere/at/all'", "does not exist"]),
])
def test_serve_rejects_bad_model_lists(args, needles):
    assert_clean_error(run_cli("serve", *args), *needles)
