"""Infrastructure every stage leans on: settings and state, outputs, stores, tracking, provenance, redaction."""
