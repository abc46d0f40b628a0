"""Weight push: plan (pure) -> reshard (gather + convert + bucket) -> transport -> servers."""
