"""Where draft tokens come from: the `Drafter` interface (`base`) and its three implementations, the model's own
draft experts (`selfdraft` over `draft_experts`, with the `affinity` table its substitution uses), an EAGLE head
(`eagle`) and prompt/output lookup (`ngram`)."""
