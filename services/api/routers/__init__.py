"""One router per resource: `models`, `jobs`, `devices` (agents and device classes), `health`."""
