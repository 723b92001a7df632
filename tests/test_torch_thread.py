"""A server runs all its torch work on one thread. OpenMP gives every thread that runs a parallel op
its own team of workers, and once a process holds more OpenMP threads than cores libgomp stops
spin-waiting between parallel regions: on 2 cores, loading on the main thread and stepping on the
engine thread halved throughput. So loading, warm-up and every engine step must share a thread."""
import asyncio
import threading

import kstep
from kstep.engine.async_engine import AsyncEngine, torch_thread
from kstep.engine.engine import Engine
from kstep.engine.offline import warm_up
from kstep.engine.request import Request
from kstep.params import GenerationParams


def test_loading_warm_up_and_steps_share_one_thread(llama_path):
    executor = torch_thread()
    llm = executor.submit(kstep.load, llama_path).result()  # as `kstep serve` loads
    load_thread = executor.submit(threading.get_ident).result()
    engine = Engine(llm, max_batch_size=4)
    step_threads, warm_up_threads = set(), set()
    real_step = engine.step

    def recorded_step():
        step_threads.add(threading.get_ident())
        return real_step()
    engine.step = recorded_step

    def recorded_warm_up(model):
        warm_up_threads.add(threading.get_ident())
        warm_up(model)

    async def serve_two_requests() -> list[list[int]]:
        async_engine = AsyncEngine(engine, executor=executor)
        await async_engine.run_on_torch_thread(recorded_warm_up, llm)  # what the server's lifespan does
        await async_engine.start()
        queues = [async_engine.submit(Request([llm.encode_prompt(p)], GenerationParams(max_tokens=4, temperature=0)))
                  for p in ("def f(x):", "import os")]
        outputs = []
        for queue in queues:
            tokens = []
            while True:
                out = await queue.get()
                tokens += [t for choice in out.choices for t in choice.token_ids]
                if out.is_finished:
                    break
            outputs.append(tokens)
        await async_engine.stop()
        return outputs

    outputs = asyncio.run(serve_two_requests())
    assert all(len(tokens) > 0 for tokens in outputs)
    assert step_threads == {load_thread} and warm_up_threads == {load_thread}
    assert load_thread != threading.get_ident()  # and that thread is not the event loop's


def test_each_served_model_warms_up_on_the_thread_it_was_loaded_on(llama_path, llada_path, monkeypatch):
    import kstep.server.app as app_module
    executors = [torch_thread(), torch_thread()]
    llms = [e.submit(kstep.load, path).result() for e, path in zip(executors, (llama_path, llada_path))]
    load_threads = [e.submit(threading.get_ident).result() for e in executors]
    warm_up_threads = {}
    monkeypatch.setattr(app_module, "warm_up", lambda model: warm_up_threads.update({id(model): threading.get_ident()}))
    app = app_module.build_app([app_module.ServedModel(name, llm, {}, e)
                                for name, llm, e in zip(("ar", "diffusion"), llms, executors)], app_module.ServeConfig())

    async def start_and_stop():
        async with app.router.lifespan_context(app):
            pass
    asyncio.run(start_and_stop())
    assert [warm_up_threads[id(llm)] for llm in llms] == load_threads and len(set(load_threads)) == 2
