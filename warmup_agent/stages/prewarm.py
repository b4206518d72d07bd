"""Stage 2, pre-warm (PRELOAD -> PRIME): tokenizer, weights, synthetic traffic.

The weight fingerprint is taken here, once the weights are loaded, and checked
again before SERVING.  Synthetic requests cover the prompt-length x batch grid,
marked as warmup so they never count as user traffic.
"""
from __future__ import annotations

from warmup_agent.states import State
from warmup_agent.traffic import PromptFactory, grid


def run(agent) -> None:
    cfg, engine = agent.cfg, agent.engine
    detail = agent.stages[-1].detail
    agent.move(State.PRELOAD)

    engine.load_tokenizer()
    agent.checkpoint()
    engine.load_weights()
    agent.checkpoint()
    agent.engine_facts = vars(engine.facts())
    agent.sm.record_fingerprint(engine.weight_fingerprint())

    agent.prompts = PromptFactory(engine.tokenize)
    shapes = grid(cfg["prewarm.prompt_lengths"], cfg["prewarm.batch_sizes"])
    per_shape = cfg["prewarm.requests_per_shape"]
    total = len(shapes) * per_shape
    done = 0
    for shape in shapes:
        for _ in range(per_shape):
            agent.checkpoint()
            agent.send(agent.prompts.batch(shape), "warmup", max_new_tokens=cfg["prewarm.max_new_tokens"])
            done += 1
            agent.progress.step(done, total, f"len={shape.prompt_tokens} batch={shape.batch}")
    detail.update(shapes=len(shapes), requests=agent.warmup_requests)
    agent.warmed_shapes = [(s.prompt_tokens, s.batch) for s in shapes]
    agent.move(State.PRIME)
