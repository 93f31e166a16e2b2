"""The server's Prometheus metrics and the per-response speculative-decoding figures.

Contract: `Metrics(engine)` owns the app's own registry (names mirror vLLM's under `assistgen:`; counters
gain `_total` in the exposition): requests running and waiting read from the engine at scrape time,
token and draft counters, time to first token, inter-token and end-to-end latency histograms, fed by the
server as chunks arrive (`step`) and requests end (`finished`). `spec_decode_metrics(stats)` is the
`metrics.speculative_decoding` object each response carries, with vLLM's names, from the request's final
`Stats`:
  num_spec_steps            = stats.draft_steps (verification steps that checked >= 1 draft token)
  num_draft_tokens          = stats.drafted_tokens
  num_accepted_draft_tokens = stats.accepted_tokens
  acceptance_histogram      = stats.accept_histogram ([i]: steps, drafting or not, that accepted i)
  mean_acceptance_length    = stats.mean_accepted_length (tokens per verification step)
  draft_acceptance_rate     = stats.acceptance_rate (accepted / drafted)
  exact                     = stats.exact (False: the model's passes are not row-exact, output may drift)
`assistgen:exact` is 1 when the engine's target is exact (`Capabilities.exact`), 0 on a stock llama.cpp build.
`Metrics.transcriptions` (`TranscriptionMetrics`) counts /v1/audio/transcriptions: its answers by HTTP status, and
for the transcribed ones the audio's seconds, the tokens generated, and the speculation figures under their own
names (`assistgen:transcription_spec_decode_*`: a speech model's acceptance is not the text model's).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from assistgen.core.state import Chunk
from assistgen.serving.batching import BatchEngine
from assistgen.stats import Stats


class EngineGauges:
    """Requests running and waiting, read from the engine at scrape time."""

    def __init__(self, engine: BatchEngine):
        self.engine = engine

    def collect(self):
        yield GaugeMetricFamily("assistgen:num_requests_running", "Requests being generated.",
                                value=self.engine.num_running)
        yield GaugeMetricFamily("assistgen:num_requests_waiting", "Requests waiting to join.",
                                value=self.engine.num_waiting)
        yield GaugeMetricFamily("assistgen:exact", "1 when the model's passes are row-exact (greedy output is plain "
                                "decoding's), 0 on a stock llama.cpp build.",
                                value=int(self.engine.target.capabilities.exact))
        prefix = self.engine.prefix
        if prefix is not None:  # (read without the engine's lock: counters only grow, a scrape may be a step behind)
            yield CounterMetricFamily("assistgen:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      value=prefix.queries)
            yield CounterMetricFamily("assistgen:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                      value=prefix.hits)
            yield CounterMetricFamily("assistgen:prefix_cache_evictions", "Kept prefixes dropped for room.",
                                      value=prefix.evictions)
            yield GaugeMetricFamily("assistgen:prefix_cache_bytes", "Bytes of keys and values kept for reuse.",
                                    value=prefix.kept_bytes)
            yield GaugeMetricFamily("assistgen:prefix_cache_capacity_bytes", "The prefix cache's bound.",
                                    value=prefix.capacity)


class Metrics:
    """The app's Prometheus metrics (names mirror vLLM's; counters gain `_total` in the exposition).

    Inter-token latency: each token of a step is observed with the time since the previous step divided
    by the step's token count, so the observations sum to the decoding time after the first token.
    """

    def __init__(self, engine: BatchEngine):
        self.registry = registry = CollectorRegistry()
        registry.register(EngineGauges(engine))

        def counter(name, doc, labels=()):
            return Counter(f"assistgen:{name}", doc, labels, registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(f"assistgen:{name}", doc, buckets=buckets, registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Verification steps that checked draft tokens.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and checked.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Steps that accepted the draft token at each position.", ["position"])
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens read.")
        self.success = counter("request_success", "Requests finished, by finish reason.", ["finished_reason"])
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.", latency)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", latency)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from request to its last token.", latency)
        self.transcriptions = TranscriptionMetrics(counter, histogram, latency)

    def step(self, job, chunk: Chunk, at: float) -> None:
        if not chunk.tokens:
            return
        if job.first_token_at is None:
            job.first_token_at = at
            self.ttft.observe(at - job.started)
        else:
            gap = (at - job.last_token_at) / len(chunk.tokens)
            for _ in chunk.tokens:
                self.itl.observe(gap)
        job.last_token_at = at

    def finished(self, job, stats: Stats | None, finish_reason: str, at: float) -> None:
        self.e2e.observe(at - job.started)
        self.success.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(len(job.prompt_ids))
        if stats is None:
            return
        self.generation_tokens.inc(stats.new_tokens)
        self.drafts.inc(stats.draft_steps)
        self.draft_tokens.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        histogram = stats.accept_histogram
        for i in range(len(histogram) - 1):
            accepted = sum(histogram[i + 1:])  # steps that accepted more than i draft tokens
            if accepted:
                self.accepted_per_pos.labels(position=str(i)).inc(accepted)


class TranscriptionMetrics:
    """/v1/audio/transcriptions: requests answered by status, what the transcribed ones heard, generated and drafted."""

    def __init__(self, counter, histogram, latency: tuple[float, ...]):
        self.requests = counter("transcription_requests", "Transcription requests answered, by HTTP status.",
                                ["status"])
        self.audio_seconds = counter("transcription_audio_seconds", "Seconds of audio transcribed.")
        self.tokens = counter("transcription_generation_tokens", "Tokens the speech model generated.")
        self.drafts = counter("transcription_spec_decode_num_drafts",
                              "Transcription verification steps that checked draft tokens.")
        self.draft_tokens = counter("transcription_spec_decode_num_draft_tokens",
                                    "Draft tokens proposed and checked in transcriptions.")
        self.accepted = counter("transcription_spec_decode_num_accepted_tokens",
                                "Draft tokens accepted in transcriptions.")
        self.latency = histogram("transcription_seconds", "Time to transcribe a request's audio (queue included).",
                                 latency)

    def answered(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def transcribed(self, stats: Stats, audio_seconds: float, seconds: float) -> None:
        self.audio_seconds.inc(audio_seconds)
        self.tokens.inc(stats.new_tokens)
        self.drafts.inc(stats.draft_steps)
        self.draft_tokens.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.latency.observe(seconds)


def spec_decode_metrics(stats: Stats | None) -> dict:
    if stats is None:
        return {}
    return {"speculative_decoding": {
        "num_spec_steps": stats.draft_steps,
        "num_draft_tokens": stats.drafted_tokens,
        "num_accepted_draft_tokens": stats.accepted_tokens,
        "acceptance_histogram": list(stats.accept_histogram),
        "mean_acceptance_length": stats.mean_accepted_length,
        "draft_acceptance_rate": stats.acceptance_rate,
        "exact": stats.exact,
    }}
