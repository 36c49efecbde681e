"""The persistent decoder: one launch for a whole forward, its plan and its grid barrier."""
