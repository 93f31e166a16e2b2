"""One server, wired in one place: what `assistgen serve` and each Ray Serve replica load, and how they serve.

Contract: a `ServerSpec` is a server's whole configuration except where it listens: the models by name with their
loading settings, the drafting options, the schedule, the engine's and the app's settings, the chat template's text.
It is plain frozen data (picklable: Ray sends it to each replica). `build_server(spec)` loads the models
(`api.loading.load_with_assistant`: the assistant first, within the target's memory budget), applies the chat
template, makes the drafter factory once to check its options (early exit's calibration runs here), and builds the
`BatchEngine`; the `Server` it returns gives the app (`server.create_app`) or runs it (`server.serve`). Costs are
measured as `spec.calibration` says ("now", the default: before it serves, where this machine has no record;
"later": a provisional curve now, the full one while idle).
Bad options raise `ConfigError` before anything serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from assistgen.api.arguments import as_schedule, default_schedule
from assistgen.api.drafting import drafter_factory
from assistgen.api.loading import load_with_assistant
from assistgen.backends.loader import LoadSettings
from assistgen.chat.templates import use_chat_template
from assistgen.drafters.factory import DrafterFactory
from assistgen.serving.app_state import ServerSettings
from assistgen.serving.batching import BatchEngine, EngineSettings
from assistgen.serving.server import create_app, serve
from assistgen.serving.speech_service import SpeechService


@dataclass(frozen=True)
class ServerSpec:
    """What a server loads and how it serves (`assistgen serve`'s options, minus where to listen)."""

    model: str
    loading: LoadSettings = field(default_factory=LoadSettings)
    assistant: str | None = None
    assistant_loading: LoadSettings = field(default_factory=LoadSettings)
    fast_linear: bool | str = "auto"  # `api.prepare`'s
    lookup: bool = False
    early_exit: bool | int = False
    schedule: object = None  # a schedule object (settings only); None: the adaptive policy
    engine: EngineSettings = field(default_factory=EngineSettings)
    settings: ServerSettings | None = None  # the app's; None: ServerSettings(model_name=model)
    chat_template: str | None = None  # the template's text, instead of the model's own
    # `api.prepare`'s: "now", where nothing is cached, the full cost measurement before the server listens (a server
    # that starts under traffic may find no idle time to measure in); "later", a provisional curve, the rest while idle
    calibration: str = "now"

    @property
    def app_settings(self) -> ServerSettings:
        return ServerSettings(model_name=self.model) if self.settings is None else self.settings


@dataclass
class Server:
    """A wired server: its engine, the drafter factory each request's drafter comes from, the app's settings."""

    engine: BatchEngine
    drafters: DrafterFactory
    settings: ServerSettings

    def app(self, speech: SpeechService | None = None):
        """The FastAPI app over the engine (`server.create_app`; its lifespan starts and stops the engine)."""
        return create_app(self.engine, self.settings, self.drafters, speech)

    def serve(self, host: str, port: int, speech: SpeechService | None = None) -> int:
        """Serve on host:port until SIGINT/SIGTERM (`server.serve`): 0 after a clean stop."""
        return serve(self.engine, self.settings, host, port, self.drafters, speech)


def build_server(spec: ServerSpec) -> Server:
    """The models loaded, the drafter factory checked and the engine built, as `spec` says."""
    settings = spec.app_settings
    target, assistant = load_with_assistant(spec.model, spec.loading, spec.assistant, spec.assistant_loading,
                                            spec.fast_linear, spec.calibration)
    if spec.chat_template is not None:
        use_chat_template(target, spec.chat_template)
    drafters = drafter_factory(target, assistant, spec.lookup, spec.early_exit, suffix=settings.suffix)
    drafters()  # bad drafter options fail here, before the server starts (and early exit's calibration runs)
    schedule = as_schedule(spec.schedule) if spec.schedule is not None else default_schedule()
    return Server(BatchEngine(target, drafters, schedule, spec.engine), drafters, settings)
