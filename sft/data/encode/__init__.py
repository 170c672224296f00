"""A conversation + the template's profile -> its samples: labels reply by reply, splitting, truncation and its
report."""
