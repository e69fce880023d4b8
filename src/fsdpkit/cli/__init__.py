"""The `fsdpkit` command line: thin verbs over the library."""
