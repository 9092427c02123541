"""fail-slow: gpus.speed (a degraded GPU's measured speed factor) and failslow_options

Revision ID: 0006
Revises: 0004 (chained after main's 0004_compact_layouts; written against 0003)
Create Date: 2026-11-24

`gpus.speed` is the speed factor the fail-slow detector measured for a GPU it made `degraded`
(1 / its time factor, in (0, 1]); NULL for every other GPU (existing rows: NULL, i.e. no
measurement). `failslow_options` holds the detector options an operator set at runtime, per job
(`scope` = the job's name) or for every job (`scope` = "*"), so they survive a restart.
"""

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.add_column(sa.Column('speed', sa.Float(), nullable=True))
    op.create_table(
        'failslow_options',
        sa.Column('scope', sa.String(length=128), primary_key=True),
        sa.Column('options', sa.JSON(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_by', sa.String(length=128), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('failslow_options')
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_column('speed')
