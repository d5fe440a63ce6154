.PHONY: install run test
install:
	bash scripts/install.sh
run:
	bash scripts/run.sh
test:
	bash scripts/test.sh
