"""Options objects: what each command reads, checked in one place."""
