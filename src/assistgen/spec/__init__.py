"""The loop's vocabulary: what a step is made of, under everything that drafts, prices or runs it.

Contract: `spec.drafts` (Draft, Proposal, the Drafter protocol, `first_draft`), `spec.steps` (StepOutcome,
the Schedule and ScheduleRun protocols) and `spec.sampling` (the Sampler) hold the words the generation loop
(`core.engine`), the drafters (`drafters/`) and the policy (`policy/`) share. They import only the layers
below (settings, the backend seam); the policy sits on them, the drafters on the policy, the loop on both.
"""
