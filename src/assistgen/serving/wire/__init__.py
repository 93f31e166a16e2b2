"""The OpenAI-compatible wire format, one module per endpoint: request bodies, what a body becomes, and the shapes
of the answers. Nothing here runs a model or touches the engine (`serving/jobs.py` and `serving/replies.py` do).

`errors` (OpenAI's error body and the app's handlers), `common` (the fields every text endpoint takes, those
refused unless "off", ids, finish reasons), `generation` (a checked body as the library's `GenerationConfig`, its
structured output included), `completions` (`POST /v1/completions`), `chat` (`POST /v1/chat/completions`), `tools`
(the tool fields of chat and responses), `responses` (`POST /v1/responses`: its body, and a generation as its output
items and events). The transcription endpoint's multipart form is `serving/transcriptions.py`'s.
"""
