"""ownership: which job owns each scale-up domain

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06

One row per owned domain; the domain is the primary key, so no domain (and no GPU of it) can be
owned by two jobs, whichever managers race to write it. A domain without a row is in the cluster's
free pool. `kind` says how the job came to own it (own, grant, borrowed) and `seq` the order the
job's planner fills its domains in.
"""

from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'allocations',
        sa.Column('domain_id', sa.String(length=128), sa.ForeignKey('domains.id'), primary_key=True),
        sa.Column('job', sa.String(length=128), sa.ForeignKey('jobs.name'), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index('ix_allocations_job', 'allocations', ['job'])


def downgrade() -> None:
    op.drop_index('ix_allocations_job', table_name='allocations')
    op.drop_table('allocations')
