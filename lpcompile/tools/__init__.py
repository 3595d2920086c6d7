"""Tools around the backend: ``lowprec dump`` (:mod:`.dump`, a compile observer),
``lowprec report`` (:mod:`.report`) and the CLI (:mod:`.cli`). Nothing in the
package imports them, but the package root turns the dump on under ``LOWPREC_DUMP``."""
